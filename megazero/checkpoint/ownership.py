"""One job at a time writes a checkpoint directory: a lock file naming the run that owns it.

Why: two jobs launched with the same ``--save`` (a resubmitted job while the first still runs,
two experiments sharing a config) both exit 0, and the directory holds whichever write came last
for each iteration, from either run. Nothing a filesystem offers makes that visible afterwards.

``SAVE/.megazero-run.lock`` holds ``{"run_id", "host", "pid", "start", "started_at"}``. Rank 0
takes it at start-up (:func:`claim`): created with ``O_EXCL``; if it exists and names another
run whose process is alive, the new job is refused with one line naming the owner. A stale lock
(its process gone on this host, or on another host no heartbeat for :data:`STALE_AFTER_S`) is
taken over with a warning. Rank 0 refreshes the heartbeat (the file's mtime) while training and
checks the lock still names its run before every save (:func:`verify`), so a job whose lock was
taken over stops saving instead of writing over the newer owner. The lock is removed when the
run ends (:func:`release`). Every checkpoint records the ``run_id`` that wrote it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from megazero.checkpoint.files import Writer
from megazero.errors import ConfigError

LOCK = ".megazero-run.lock"
#: A lock on another host whose heartbeat is older than this is stale (its job is gone).
STALE_AFTER_S = 300.0
#: How often a running job refreshes its heartbeat.
HEARTBEAT_S = 30.0


class SaveDirBusy(ConfigError):
    """Another live job owns the ``--save`` directory."""


@dataclass(frozen=True)
class RunOwner:
    run_id: str
    host: str
    pid: int
    start: str  # the process's start time in clock ticks (/proc/<pid>/stat): pids are reused
    started_at: str

    @staticmethod
    def this_process(run_id: str) -> RunOwner:
        from megazero.distributed.peers import _stat

        stat = _stat(os.getpid())
        return RunOwner(run_id, socket.gethostname(), os.getpid(), stat[1] if stat else "?",
                        time.strftime("%Y-%m-%d %H:%M:%S"))

    def describe(self) -> str:
        return (f"run {self.run_id} (host {self.host}, pid {self.pid}, started "
                f"{self.started_at})")


def new_run_id() -> str:
    """Time-ordered and unique enough for a directory: ``20261125-214501-3fa2c1``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def lock_path(save_dir: str) -> str:
    return os.path.join(save_dir, LOCK)


def read_owner(save_dir: str) -> RunOwner | None:
    try:
        with open(lock_path(save_dir), encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
        return RunOwner(str(data["run_id"]), str(data["host"]), int(data["pid"]),
                        str(data["start"]), str(data.get("started_at", "?")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def owner_alive(owner: RunOwner, save_dir: str, now: float | None = None) -> bool:
    """On this host: the very process (pid and start time) still exists. Elsewhere its process
    cannot be looked at, so the heartbeat decides."""
    from megazero.distributed.peers import _stat

    if owner.host == socket.gethostname():
        stat = _stat(owner.pid)
        return stat is not None and stat[0] not in "ZXx" and stat[1] == owner.start
    try:
        beat = os.path.getmtime(lock_path(save_dir))
    except OSError:
        return False
    return (now if now is not None else time.time()) - beat < STALE_AFTER_S


def _write(save_dir: str, me: RunOwner, exclusive: bool) -> None:
    text = json.dumps(asdict(me), indent=1)
    path = lock_path(save_dir)
    if exclusive:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return
    Writer().text(text, path)  # atomic: temporary name, fsync, rename


def claim(save_dir: str, me: RunOwner) -> str | None:
    """Take the lock of ``save_dir`` for ``me``; a warning when a stale lock was taken over.
    Raises :class:`SaveDirBusy` naming the owner when a live job holds it."""
    os.makedirs(save_dir, exist_ok=True)
    try:
        _write(save_dir, me, exclusive=True)
        return None
    except FileExistsError:
        pass
    owner = read_owner(save_dir)
    if owner is not None and owner.run_id == me.run_id:
        return None
    if owner is not None and owner_alive(owner, save_dir):
        raise SaveDirBusy(
            f"--save {save_dir} is in use by {owner.describe()}: two jobs saving into one "
            f"directory overwrite each other's checkpoints. Wait for it to end, or give this "
            f"job another --save. If that job is gone, delete {lock_path(save_dir)}")
    _write(save_dir, me, exclusive=False)
    taken = read_owner(save_dir)
    if taken is None or taken.run_id != me.run_id:  # another job took it over at the same time
        raise SaveDirBusy(f"--save {save_dir} was claimed by "
                          f"{taken.describe() if taken else 'another job'} at the same time as "
                          f"this one; give this job another --save")
    what = owner.describe() if owner is not None else "an unreadable lock"
    return (f"--save {save_dir}: took over the lock of {what}, whose process is gone; "
            f"this run is {me.run_id}")


def verify(save_dir: str, me: RunOwner) -> str | None:
    """Why ``me`` may not save into ``save_dir`` now (its lock was taken over or removed), or
    None; refreshes the heartbeat when the lock is ours."""
    owner = read_owner(save_dir)
    if owner is None:
        try:
            _write(save_dir, me, exclusive=True)  # removed by hand: take it again
            return None
        except OSError:
            owner = read_owner(save_dir)
    if owner is None or owner.run_id != me.run_id:
        who = owner.describe() if owner is not None else "another job"
        return (f"--save {save_dir} now belongs to {who} (this job's lock was taken over while "
                f"it was not heard from for {STALE_AFTER_S:.0f} s); not saving over its "
                f"checkpoints. Resume this run in another directory with --load {save_dir} "
                f"--save NEW_DIR")
    heartbeat(save_dir)
    return None


_last_beat: dict[str, float] = {}


def heartbeat(save_dir: str, every_s: float = 0.0) -> None:
    """Touch the lock (at most once every ``every_s`` seconds): a live job's lock on another
    host is told from a dead one's by this."""
    now = time.monotonic()
    if every_s and now - _last_beat.get(save_dir, -every_s) < every_s:
        return
    _last_beat[save_dir] = now
    try:
        os.utime(lock_path(save_dir))
    except OSError:
        pass


def release(save_dir: str, me: RunOwner) -> None:
    """Remove the lock if it is still ``me``'s."""
    owner = read_owner(save_dir)
    if owner is not None and owner.run_id == me.run_id:
        try:
            os.remove(lock_path(save_dir))
        except OSError:
            pass
