"""Checkpoint writers that fail on purpose, to test crash safety."""

from __future__ import annotations

import os

from megazero.checkpoint.files import Writer


class SimulatedCrash(BaseException):
    """Raised by :class:`CrashingWriter` in place of the process dying. A ``BaseException``,
    like ``SystemExit``: error handlers that turn write failures into messages must not
    swallow a death."""


class CrashingWriter(Writer):
    """Commits ``after`` files, then crashes: raises :class:`SimulatedCrash` or, with
    ``hard=True``, ends the process at once (``os._exit(17)``, as kill -9 or a node failure
    would: no cleanup, temporaries and half a checkpoint left on disk). With
    ``leave_tmp=True`` file number ``after`` is written under its temporary name and the crash
comes before its rename."""

    def __init__(self, after: int, hard: bool = False, leave_tmp: bool = False) -> None:
        super().__init__()
        self.after, self.hard, self.leave_tmp = after, hard, leave_tmp

    def _crash(self) -> None:
        if self.hard:
            os._exit(17)
        raise SimulatedCrash(f"simulated crash after {len(self.written)} files")

    def commit(self, tmp: str, path: str) -> None:
        if self.leave_tmp and len(self.written) + 1 >= self.after:
            # as a process with another pid would leave it (a retry here reuses our pid)
            os.replace(tmp, tmp.rsplit(".", 1)[0] + ".4194305")
            self._crash()
        super().commit(tmp, path)
        if len(self.written) >= self.after:
            self._crash()
