"""The layout search's progress on a terminal: a bar of layouts tried, the best layout so far
and the time left, on one line redrawn in place (or, when the output is not a terminal, one line
every few seconds)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class ProgressBar:
    """``bar(what, done, known, best)``, the search's progress callback: first the shapes being
    timed (all known in advance), then the layouts tried fastest first, whose ``known`` grows as
    slower variants come into the race (the time left is then an upper bound: most layouts never
    need trying)."""

    def __init__(self, stream: TextIO | None = None, width: int = 24, every_s: float = 0.2,
                 quiet_every_s: float = 5.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width, self.start = width, time.monotonic()
        self.every = every_s if self.tty else quiet_every_s
        self.last = -1e9
        self.drawn = False
        self._phase: str | None = None
        self._phase_start = self.start

    def line(self, what: str, done: int, known: int, best: Any) -> str:
        now = time.monotonic()
        if what != self._phase:  # each phase's rate from its own start
            self._phase, self._phase_start = what, now
        elapsed, spent = now - self.start, now - self._phase_start
        share = done / known if known else 1.0
        full = int(self.width * share)
        left = spent / done * (known - done) if done else 0.0
        best_text = (f"best so far {best.label} {best.est.time.seconds:.3f} s"
                     if best is not None else "none fits yet")
        return (f"[{'#' * full}{'.' * (self.width - full)}] {done}/{known} {what}, "
                f"{best_text}, {elapsed:.0f} s elapsed, about {left:.0f} s left")

    def __call__(self, what: str, done: int, known: int, best: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.every and what == self._phase:
            return
        self.last = now
        text = self.line(what, done, known, best)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.drawn = True

    def done(self, message: str) -> None:
        """The search's closing line (replacing the bar on a terminal)."""
        self.stream.write(("\r\x1b[2K" if self.tty and self.drawn else "") + message + "\n")
        self.stream.flush()
