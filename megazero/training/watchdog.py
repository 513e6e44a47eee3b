"""A daemon thread that ends a stuck or orphaned rank instead of letting it hang.

Why: a rank blocked in a collective (a peer frozen, killed, or waiting in another collective)
waits for the process group's timeout, and with NCCL possibly forever; the job then burns its
allocation silently. And when the ``torchrun`` launcher dies (OOM-killed, ``kill -9``), its
workers are re-parented and keep running, holding GPUs and ports. The watchdog turns both into
one message on stderr and an exit with :data:`WATCHDOG_EXIT_CODE`.

The training loop marks what it is doing with :meth:`Watchdog.phase` (an iteration's
forward-backward, the data-parallel gradient sync, the optimizer step, the exit check), naming
the process group it talks over, so the message says which rank, group and operation is stuck::

    with watchdog.phase("grad-sync", group="dp", ranks=[0, 2]):
        engine.finish_grad_sync()

The thread wakes every ``poll_s`` seconds; it uses no collective itself (it must still work
when the collectives do not), and ends the process with ``os._exit``: a stuck collective
cannot be interrupted from another thread, and exit handlers may block on it too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

#: Exit status of a rank the watchdog ended (stuck phase or dead launcher).
WATCHDOG_EXIT_CODE = 75


def _is_collective_failure(exc: BaseException) -> bool:
    """A torch.distributed backend error (gloo/NCCL timeouts and closed connections)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        k in text for k in ("gloo", "Gloo", "NCCL", "Timed out", "Connection closed by peer"))


class Watchdog:
    """Ends this process when a :meth:`phase` runs longer than ``limit_s`` seconds, or when
    the parent process (the launcher) is gone.

    ``out`` receives the one message (default stderr); ``exit`` ends the process (default
    ``os._exit``); both are injectable for tests. ``watch_parent`` compares the parent pid
    with the one seen at start: a re-parented process has lost its launcher. ``diagnose``
    (:meth:`megazero.distributed.peers.PeerRegistry.diagnose`) names the dead or stopped peers
    among a group's ranks in the message.
    """

    def __init__(self, limit_s: float, rank: int, *, poll_s: float | None = None,
                 watch_parent: bool = True, out: TextIO | None = None,
                 exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic,
                 diagnose: Callable[[Sequence[int]], str | None] | None = None) -> None:
        if limit_s <= 0:
            raise ValueError(f"watchdog limit must be > 0 seconds, got {limit_s}")
        self.limit_s = float(limit_s)
        self.rank = rank
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.05, self.limit_s / 10))
        self.watch_parent = watch_parent
        self.out = out
        self._exit = exit
        self._clock = clock
        self._diagnose = diagnose
        self._parent = os.getppid()
        self._lock = threading.Lock()
        self._current: tuple[str, str | None, tuple[int, ...], float] | None = None
        self._stop = threading.Event()
        self._voice = threading.Lock()  # taken by whichever path prints this rank's one message
        self._thread: threading.Thread | None = None
        self.fired: str | None = None
        self.failed: tuple[str, str | None, tuple[int, ...], float] | None = None
        self.failed_after = 0.0

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Watchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="megazero-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll_s + 1)
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what the loop is doing ----------------------------------------------------------------

    @contextmanager
    def phase(self, what: str, group: str | None = None,
              ranks: Sequence[int] = ()) -> Iterator[None]:
        """Watch the enclosed block: ``what`` (an operation), over ``group`` (its ranks)."""
        previous = self._current
        with self._lock:
            self._current = (what, group, tuple(ranks), self._clock())
        try:
            yield
        except BaseException:
            if self.failed is None:  # the innermost phase names the failure
                self.failed = self._current
                self.failed_after = self._clock() - self._current[3]
            raise
        finally:
            with self._lock:
                self._current = previous

    def take_voice(self) -> bool:
        """True once per process: the thread's stuck-phase exit and the loop's failed
        collective may see the same hang at the same moment; only the first one speaks."""
        return self._voice.acquire(blocking=False)

    def failure_message(self, exc: BaseException) -> str | None:
        """One line for a collective that failed inside a phase (the backend's own timeout
        fired, or a peer closed its connection), or None when ``exc`` is no such failure."""
        if self.failed is None or not _is_collective_failure(exc):
            return None
        what, group, ranks, _ = self.failed
        where = f" over the {group} group (ranks {list(ranks)})" if group else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        cause = self._cause(ranks) or "A peer rank is stuck or dead (see its own output)"
        return (f"[rank {self.rank}] {what}{where} failed after {self.failed_after:.1f}s: "
                f"{first}. {cause}; ending the job")

    def _cause(self, ranks: Sequence[int]) -> str | None:
        if self._diagnose is None:
            return None
        try:
            return self._diagnose(ranks)
        except Exception:  # noqa: BLE001 - the message must go out whatever the diagnosis does
            return None

    # --- the thread ----------------------------------------------------------------------------

    def check(self) -> str | None:
        """The reason to end the process now, or None (one poll of the thread)."""
        if self.watch_parent and os.getppid() != self._parent:
            return (f"[rank {self.rank}] watchdog: the launcher (parent pid {self._parent}) "
                    f"is gone; ending this orphaned rank")
        with self._lock:
            current = self._current
        if current is None:
            return None
        what, group, ranks, since = current
        waited = self._clock() - since
        if waited <= self.limit_s:
            return None
        where = f" over the {group} group (ranks {list(ranks)})" if group else ""
        cause = self._cause(ranks) or "a peer rank is stuck, dead or in another collective"
        return (f"[rank {self.rank}] watchdog: {what}{where} has not finished after "
                f"{waited:.1f}s (limit {self.limit_s:g}s, --distributed-timeout-minutes); "
                f"{cause}. Ending the job")

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            reason = self.check()
            if reason is not None:
                self.fired = reason
                out = self.out or sys.stderr
                try:
                    if self.take_voice():
                        print(reason, file=out, flush=True)
                finally:
                    self._exit(WATCHDOG_EXIT_CODE)
                return
