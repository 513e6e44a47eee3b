"""``--save`` checked before the first iteration, and checkpoint write failures explained.

Why: a run that learns at hour six that its checkpoint directory is read-only, a file, or on
a full disk has lost six hours. At start-up the directory must exist or be creatable, accept a
file, and have room for one checkpoint of this model: the parameter and optimizer-state bytes
every rank holds (the engine's own accounting), summed over ranks.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megazero.config import ConfigError

if TYPE_CHECKING:
    from megazero.topology import ParallelTopology


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def checkpoint_bytes(engine: Any) -> int:
    """Bytes this rank writes to a checkpoint: its parameters and optimizer state."""
    report = engine.memory_report()["bytes"]
    return int(sum(report["params"].values()) + sum(report["optimizer"].values()))


def save_dir_problem(path: str, needed_bytes: int,
                     disk_usage: Callable[[str], Any] = shutil.disk_usage) -> str | None:
    """Why ``path`` cannot take a checkpoint of ``needed_bytes``, or None if it can."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--save {path} is not a directory; point --save at a writable directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return (f"--save {path}: cannot create the checkpoint directory: {e.strerror or e} "
                f"({e.filename or path}); point --save at a writable directory")
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return (f"--save {path} is not writable: {e.strerror or e}; point --save at a "
                f"writable directory")
    free = disk_usage(path).free
    if free < needed_bytes:
        return (f"--save {path}: {_human(free)} free on its file system, but one checkpoint of "
                f"this model needs about {_human(needed_bytes)} (parameters and optimizer state "
                f"of all ranks); free some space or point --save elsewhere")
    return None


def explain_write_error(path: str, iteration: int, exc: BaseException,
                        disk_usage: Callable[[str], Any] = shutil.disk_usage) -> str:
    """One line for a failed checkpoint write: which path, and the operating system's reason.
    ``torch.save`` reports a full disk as a RuntimeError without errno; then the free space
    of ``path`` is looked up to name the likely cause."""
    if isinstance(exc, OSError):
        where = exc.filename or path
        reason = exc.strerror or str(exc)
    else:
        where, reason = path, str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        try:
            if disk_usage(path).free < 1 << 20:
                reason = f"{os.strerror(errno.ENOSPC)} ({reason})"
        except OSError:
            pass
    return (f"writing the checkpoint of iteration {iteration} to {where} failed: {reason}. "
            f"The previous checkpoint in {path} is still the latest; free space or fix the "
            f"directory and resume with --load {path}")


def check_save_dir(path: str | None, rank_bytes: int, topo: ParallelTopology, device: Any) -> None:
    """Collective: ``--save`` usable by every rank, with room for one checkpoint of
    ``rank_bytes`` summed over ranks. Every rank raises alike, so none waits for the others."""
    import torch
    import torch.distributed as dist

    if not path:
        return
    sizes = torch.tensor([float(rank_bytes)], dtype=torch.float64, device=device)
    if topo.world_size > 1:
        dist.all_reduce(sizes)
    problem = save_dir_problem(path, int(sizes.item()))
    failed = torch.tensor([float(problem is not None)], device=device)
    if topo.world_size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() > 0:
        raise ConfigError(problem or f"--save {path}: another rank cannot write there (see "
                          f"its message)")
