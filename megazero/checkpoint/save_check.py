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


def host_memory_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory the kernel reports available (``MemAvailable``), or None."""
    try:
        with open(meminfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def staging_problem(rank_bytes: int, ranks_on_host: int, available: int | None) -> str | None:
    """Why ``--async-save`` cannot stage this rank's state in host memory, or None. Each rank
    holds a host copy of its parameters and optimizer state from the save step until its files
    are written; the ranks of a host do it at once."""
    if available is None:
        return None
    needed = rank_bytes * max(1, ranks_on_host)
    if needed <= available * 0.9:  # what the training itself allocates later needs room too
        return None
    return (f"--async-save: each rank copies its parameters and optimizer state to host memory "
            f"at a save ({_human(rank_bytes)} on this rank, {_human(needed)} for the "
            f"{ranks_on_host} ranks of this host), but the host has {_human(available)} "
            f"available; save synchronously (drop --async-save), or shard the state over more "
            f"ranks (a higher ZeRO stage or more nodes)")


def check_staging(rank_bytes: int, ranks_on_host: int, topo: ParallelTopology,
                  device: Any) -> None:
    """Collective, before the first iteration: every rank's staging area fits its host."""
    problem = staging_problem(rank_bytes, ranks_on_host, host_memory_available())
    if any_rank(problem is not None, topo, device):
        raise ConfigError(problem or "--async-save: another host cannot stage its ranks' state "
                          "in host memory (see its message); drop --async-save")


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
    the iteration folders that megazero can prove are its own unfinished saves: no
    ``metadata.json``, the in-progress marker every rank writes before its first file
    (:data:`~megazero.checkpoint.files.SAVE_IN_PROGRESS`), an iteration above the tracker's,
    and only megazero's file names. Any other folder without ``metadata.json`` (a checkpoint
    whose index was lost, a copy still in progress, a file system not yet showing it) is never
    deleted: it is refused with a :class:`ConfigError` naming it. Call only while this job
    holds the directory's lock. Returns what was removed and how many bytes that freed."""
    from megazero.checkpoint.files import SAVE_IN_PROGRESS, TMP_TAG
    from megazero.checkpoint.reader import MARKER, TRACKER

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

    latest = _tracker_iteration(os.path.join(path, TRACKER))
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
        full = os.path.join(path, name)
        if os.path.isfile(full) and TMP_TAG in name:
            drop(full)
            continue
        if not (os.path.isdir(full) and _ITER_DIR.fullmatch(name)):
            continue
        complete = os.path.exists(os.path.join(full, MARKER))
        marked = os.path.exists(os.path.join(full, SAVE_IN_PROGRESS))
        if not complete:
            iteration = int(name[len("iter_"):])
            if marked and (latest is None or iteration > latest) and _only_ours(full):
                for base, _, names in os.walk(full):
                    for n in names:
                        drop(os.path.join(base, n))
                shutil.rmtree(full, ignore_errors=True)
                continue
            why = ("it is at or below the iteration the tracker names" if marked and
                   latest is not None and iteration <= latest else
                   "it holds files megazero does not write" if marked else
                   "nothing shows it is an unfinished save of megazero's (a checkpoint whose "
                   "metadata.json was lost, or a copy still in progress?)")
            raise ConfigError(f"--save {path}: {full} has no metadata.json, so it is not a "
                              f"complete checkpoint, and {why}; megazero deletes only its own "
                              f"unfinished saves. Move the folder out of {path} (or restore its "
                              f"metadata.json), then launch again")
        for base, _, names in os.walk(full):
            for n in names:
                if TMP_TAG in n or (marked and n == SAVE_IN_PROGRESS and base == full):
                    drop(os.path.join(base, n))  # a committed save's stale marker too
    return removed, freed


def _tracker_iteration(tracker: str) -> int | None:
    try:
        with open(tracker, encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


_ITER_DIR = re.compile(r"iter_\d{7,}")
_OUR_FILES = re.compile(r"(model|optim|optim_rng|extra_state)(_\d+)?\.pt|config\.json|"
                        r"\.megazero-save-in-progress|.*\.tmp\.\d+")
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
        except (ConfigError, OSError) as e:  # another job's lock, a folder not to delete
            problem = str(e) if isinstance(e, ConfigError) else (
                f"--save {path}: cannot take the directory's lock: {e}")
    if any_rank(problem is not None, topo, device):
        raise SaveDirBusy(problem or f"--save {path} cannot be used as it is (see rank 0's "
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
