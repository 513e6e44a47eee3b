"""Checkpoint files: atomic writes through an injectable writer, checksums, safe loading.

Every file is written under ``<name>.tmp.<pid>`` and renamed into place (atomic on POSIX).
The writer is an object passed to ``save_checkpoint`` (like ``barrier=``), so tests inject a
writer that crashes after N files instead of the library reading a test environment variable.

Loading never unpickles code: ``torch.load(..., weights_only=True)`` accepts tensors and plain
containers only, and every file's SHA-256 recorded in ``metadata.json`` is checked first, so a
truncated, bit-flipped or swapped shard is reported by name before any of it is used.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from megazero.errors import CheckpointError

TMP_TAG = ".tmp."
#: Written into an iteration's directory by every rank before its first file of a save, and
#: removed once the save is committed (``metadata.json`` and the tracker written): a directory
#: that holds it and no ``metadata.json`` is provably an unfinished save of megazero's.
SAVE_IN_PROGRESS = ".megazero-save-in-progress"


class Writer:
    """Atomic writes; ``written`` lists the relative paths committed so far."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def commit(self, tmp: str, path: str) -> None:
        os.replace(tmp, path)
        self.written.append(path)

    def torch(self, obj: Any, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP_TAG}{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        self.commit(tmp, path)

    def text(self, text: str, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP_TAG}{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.commit(tmp, path)


def mark_in_progress(directory: str, run_id: str | None = None) -> None:
    """Create ``directory`` and its :data:`SAVE_IN_PROGRESS` marker (atomically; every rank
    may write it, with the same text). Written directly, not through a save's injectable
    writer, so fault injection counts the save's own files only."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SAVE_IN_PROGRESS)
    tmp = f"{path}{TMP_TAG}{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{run_id or ''}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_stale_tmp(directory: str) -> list[str]:
    """Delete ``*.tmp.<pid>`` leftovers of crashed saves under ``directory`` (not recursive
    beyond it); call only after a save of that directory completed on every rank."""
    removed = []
    for base, _, names in os.walk(directory):
        for n in names:
            if TMP_TAG in n:
                os.remove(os.path.join(base, n))
                removed.append(os.path.join(base, n))
    return removed


def verified_load(path: str, expected: dict[str, Any] | None, mmap: bool = True) -> Any:
    """``torch.load`` with ``weights_only=True`` after checking the file against its recorded
    size and SHA-256; every failure is a :class:`CheckpointError` naming ``path``."""
    verify(path, expected)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise CheckpointError(f"checkpoint file {path} cannot be read safely "
                              f"(weights_only load failed: {str(e).splitlines()[0]})") from None


def verify(path: str, expected: dict[str, Any] | None) -> None:
    """``path`` exists, with the size and SHA-256 that ``metadata.json`` records for it."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete "
                              "(copy it again or load an earlier iteration)")
    if expected is None:
        return
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {size} bytes, metadata.json "
                              f"records {expected['bytes']}: the file is truncated or "
                              "replaced; copy it again or load an earlier iteration")
    if sha256(path) != expected["sha256"]:
        raise CheckpointError(f"checkpoint file {path} fails its SHA-256 check (corrupted); "
                              "copy it again or load an earlier iteration")
