"""Faults on purpose: checkpoint writers that crash or fail, and the worker processes of a
launcher (to kill or freeze one)."""

from __future__ import annotations

import errno
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


class FailingWriter(Writer):
    """Raises ``OSError(errno_)`` in place of committing file number ``at`` (1-based, counted
    over this writer's life), as a full disk (``ENOSPC``) or a quota would; the temporary it
    wrote is removed, as the operating system leaves no partial file to rename."""

    def __init__(self, at: int, errno_: int = errno.ENOSPC) -> None:
        super().__init__()
        self.at, self.errno = at, errno_

    def commit(self, tmp: str, path: str) -> None:
        if len(self.written) + 1 == self.at:
            os.remove(tmp)
            raise OSError(self.errno, os.strerror(self.errno), path)
        super().commit(tmp, path)


def launched_ranks(launcher_pid: int) -> dict[int, int]:
    """``{RANK: pid}`` of the worker processes a launcher (``torchrun``) started."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(d)
    return out
