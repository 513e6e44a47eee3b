"""On-disk cache of index arrays: keyed by a hash, written atomically, built by one rank.

The key is the SHA-256 of a JSON description of everything that determines the arrays, so a
changed path, document range, sequence length, sample count, seed or split gets new files, and
a stale cache can never be read by mistake. Files are written under temporary names and renamed,
so a reader sees either nothing or complete files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _save_atomic(path: str, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def default_is_builder(group=None) -> bool:
    """Rank 0 of ``group`` (or of the world) builds; without torch.distributed, this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group) == 0
    return True


def default_barrier(group=None) -> Callable[[], None] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return lambda: dist.barrier(group=group)
    return None


class IndexCache:
    """``<cache_dir>/<hash>-<name>.npy`` files plus ``<hash>-description.json``."""

    def __init__(self, cache_dir: str, description: dict, names: Sequence[str]) -> None:
        self.cache_dir = cache_dir
        self.description = description
        self.key = description_hash(description)
        self.names = list(names)
        self.paths = {n: os.path.join(cache_dir, f"{self.key}-{n}.npy") for n in self.names}
        self.description_path = os.path.join(cache_dir, f"{self.key}-description.json")

    def complete(self) -> bool:
        return all(os.path.isfile(p) for p in self.paths.values()) and os.path.isfile(
            self.description_path)

    def load(self) -> dict[str, np.ndarray]:
        return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in self.paths.items()}

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            self._save(arrays)
        except OSError as e:
            raise OSError(f"cannot write the index cache to {self.cache_dir!r} ({e}); pass a "
                          "writable cache directory (cache_dir)") from e

    def _save(self, arrays: dict[str, np.ndarray]) -> None:
        for n in self.names:
            _save_atomic(self.paths[n], arrays[n])
        # The description goes last: its presence marks the set as complete.
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.description, f, indent=1, sort_keys=True)
        os.replace(tmp, self.description_path)

    def get_or_build(self, build: Callable[[], dict[str, np.ndarray]], is_builder: bool = True,
                     barrier: Callable[[], None] | None = None, timeout_s: float = 3600.0,
                     poll_s: float = 0.05, progress: Callable[[float], None] | None = None,
                     progress_every_s: float = 60.0) -> tuple[dict[str, np.ndarray], bool]:
        """Load the arrays, building and saving them first if needed; returns ``(arrays, built)``.

        Only the builder builds. With a ``barrier`` (e.g. ``torch.distributed.barrier``) every
        rank calls it once after the builder has saved; without one, other ranks poll for the
        finished files (atomic renames make that safe), up to ``timeout_s``, calling
        ``progress(seconds waited)`` every ``progress_every_s``. Polling is the choice for a
        build that may outlast a collective's timeout (NCCL's is 10 minutes by default).
        """
        built = False
        if is_builder and not self.complete():
            self.save(build())
            built = True
        if barrier is not None:
            barrier()
        elif not is_builder:
            start = time.monotonic()
            next_report = start + progress_every_s
            while not self.complete():
                now = time.monotonic()
                if now > start + timeout_s:
                    raise TimeoutError(f"waited {timeout_s:.0f}s for the index cache "
                                       f"{self.description_path} built by another rank; is "
                                       "the cache directory shared between the ranks?")
                if progress is not None and now >= next_report:
                    progress(now - start)
                    next_report = now + progress_every_s
                time.sleep(poll_s)
        if not self.complete():
            raise RuntimeError(f"index cache {self.description_path} is missing after the build "
                               "barrier; is the cache directory shared between ranks?")
        return self.load(), built
