"""``--save`` checked before the first iteration, and checkpoint write failures explained.

Why: a run that learns at hour six that its checkpoint directory is read-only, a file, or on
a full disk has lost six hours. At start-up the directory must exist or be creatable, accept a
file, and have room for one checkpoint of this model: the parameter and optimizer-state bytes
every rank holds (the engine's own accounting), summed over ranks. Before that check the
directory is claimed for this run (:func:`claim_save_dir`, one job at a time) and megazero's own
failed saves there are removed, so the space they hold is not counted against the run.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megazero.config import ConfigError

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


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
    if any_rank(problem is not None, topo, device):
        raise ConfigError(problem or f"--save {path}: another rank cannot write there (see "
                          f"its message)")


def remove_failed_saves(path: str) -> tuple[list[str], int]:
    """megazero's own leftovers in ``path``: ``*.tmp.<pid>`` files of interrupted writes, and
    iteration folders that never became complete (no ``metadata.json``) and hold only
    megazero's file names. Call only while this job holds the directory's lock. Returns what
    was removed and how many bytes that freed."""
    from megazero.checkpoint.files import TMP_TAG
    from megazero.checkpoint.reader import MARKER

    removed: list[str] = []
    freed = 0

    def drop(file: str) -> None:
        nonlocal freed
        try:
            size = os.path.getsize(file)
            os.remove(file)
        except OSError:
            return
        freed += size
        removed.append(file)

    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
        full = os.path.join(path, name)
        if os.path.isfile(full) and TMP_TAG in name:
            drop(full)
        elif (os.path.isdir(full) and _ITER_DIR.fullmatch(name)
              and not os.path.exists(os.path.join(full, MARKER)) and _only_ours(full)):
            for base, _, names in os.walk(full):
                for n in names:
                    drop(os.path.join(base, n))
            shutil.rmtree(full, ignore_errors=True)
        elif os.path.isdir(full) and _ITER_DIR.fullmatch(name):
            for base, _, names in os.walk(full):
                for n in names:
                    if TMP_TAG in n:
                        drop(os.path.join(base, n))
    return removed, freed


_ITER_DIR = re.compile(r"iter_\d{7,}")
_OUR_FILES = re.compile(r"(model|optim|optim_rng|extra_state)(_\d+)?\.pt|config\.json|.*\.tmp\.\d+")
_OUR_DIRS = re.compile(r"mp_rank_\d{2}_\d{3}(_\d{3})?")


def _only_ours(directory: str) -> bool:
    """Every entry under ``directory`` has a name megazero's save writes."""
    for base, dirs, names in os.walk(directory):
        if base != directory and not _OUR_DIRS.fullmatch(os.path.basename(base)):
            return False
        if any(not _OUR_FILES.fullmatch(n) for n in names):
            return False
        if any(not _OUR_DIRS.fullmatch(d) for d in dirs):
            return False
    return True


def claim_save_dir(path: str, owner: Any, topo: ParallelTopology, device: Any) -> list[str]:
    """Collective: rank 0 takes ``path``'s lock for ``owner``
    (:mod:`megazero.checkpoint.ownership`), then removes megazero's own failed saves there, so
    the free-space check that follows counts the space they held. Every rank raises alike when
    another live job owns the directory. Returns rank 0's lines to log."""

    from megazero.checkpoint.ownership import SaveDirBusy, claim

    lines: list[str] = []
    problem = None
    if topo.rank == 0:
        problem = save_dir_problem(path, 0)  # a file, unwritable...: said as such first
    if topo.rank == 0 and problem is None:
        try:
            taken_over = claim(path, owner)
            if taken_over:
                warnings.warn(taken_over, stacklevel=2)
            removed, freed = remove_failed_saves(path)
            if removed:
                lines.append(f"> removed {len(removed)} files ({_human(freed)}) left in {path} "
                             f"by an earlier save that did not complete")
        except (SaveDirBusy, OSError) as e:
            problem = str(e) if isinstance(e, SaveDirBusy) else (
                f"--save {path}: cannot take the directory's lock: {e}")
    if any_rank(problem is not None, topo, device):
        raise SaveDirBusy(problem or f"--save {path} is in use by another job (see rank 0's "
                          f"message)")
    return lines


def save_allowed(path: str, owner: Any, topo: ParallelTopology, device: Any) -> None:
    """Collective, before each save: the directory's lock still names this run (rank 0 checks
    and refreshes it); otherwise every rank raises a CheckpointError and nothing is written."""

    from megazero.checkpoint.ownership import verify
    from megazero.errors import CheckpointError

    problem = verify(path, owner) if topo.rank == 0 and owner is not None else None
    if any_rank(problem is not None, topo, device):
        raise CheckpointError(problem or f"--save {path} now belongs to another job (see rank "
                              f"0's message)")


def any_rank(flag: bool, topo: ParallelTopology, device: Any) -> bool:
    """Collective: whether ``flag`` holds on any rank (a MAX all-reduce of one element on the
    rank's device), so that every rank raises alike and none waits for a peer that left."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(flag)], device=device)
    if topo.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() > 0
