"""The largest token id of an indexed dataset, computed once and cached beside its indices,
checked against the model's vocabulary before training starts.

Why: a corpus preprocessed with another tokenizer holds ids the model has no row for. At TP=1
the embedding fails mid-step with a bare "index out of range"; at TP>1 the vocab-parallel
embedding and cross entropy mask ids outside every rank's slice, so the run trains on zero
vectors and wrong targets without a word. One pass over the ``.bin`` (cached, keyed by the
files' sizes and modification times) turns that into an error naming the file and both sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from megazero.data.index_cache import IndexCache, default_is_builder
from megazero.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

_FORMAT = 2  # 2: the smallest id too (an int32 corpus written by another tool may hold -1)
_CHUNK_TOKENS = 1 << 24  # bounded memory for the scan of a large .bin
# how long the other ranks wait for the scan: a day (a corpus that takes longer is read at
# under 10 MB/s); progress is printed every minute meanwhile
POLL_TIMEOUT_S = 24 * 3600.0


def _scan_range(ds: IndexedDataset) -> tuple[int, int]:
    """Smallest and largest token id in ``ds`` ((0, -1) when it holds no tokens), chunk by
    chunk."""
    total = int(ds.sequence_lengths.sum(dtype=np.int64))
    lo, hi = 0, -1
    for start in range(0, total, _CHUNK_TOKENS):
        chunk = ds.read_tokens(start, min(_CHUNK_TOKENS, total - start))
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    return lo, hi


def max_token_id(ds: IndexedDataset, cache_dir: str, is_builder: bool | None = None,
                 barrier: Callable[[], None] | None = None, group=None) -> int:
    """The largest token id in ``ds`` (see :func:`token_id_range`)."""
    return token_id_range(ds, cache_dir, is_builder, barrier, group)[1]


def token_id_range(ds: IndexedDataset, cache_dir: str, is_builder: bool | None = None,
                   barrier: Callable[[], None] | None = None, group=None) -> tuple[int, int]:
    """The smallest (at most 0) and largest token id in ``ds``, from the index cache in
    ``cache_dir`` when present. One rank scans; the others read its result.

    The scan reads the whole ``.bin``: on a first run over a large corpus that takes longer
    than a collective's timeout (NCCL: 10 minutes by default), so by default the other ranks
    do not wait in a barrier but poll for the result file, which the scanning rank writes
    atomically, and say every minute what they wait for. A ``barrier`` given explicitly is
    used instead."""
    prefix = ds.path_prefix
    files = {}
    for kind, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        st = os.stat(path)
        files[kind] = {"path": os.path.abspath(path), "size": st.st_size,
                       "mtime_ns": st.st_mtime_ns}
    cache = IndexCache(cache_dir, {"class": "MaxTokenId", "format": _FORMAT, **files},
                       ["token_id_range"])
    if is_builder is None:
        is_builder = default_is_builder(group)

    def waiting(seconds: float) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank(group) != 1:
            return  # one waiting rank speaks for all
        print(f"waiting for another rank to scan {data_file_path(prefix)} for its token ids "
              f"({seconds:.0f}s so far; the result is cached in {cache_dir})", flush=True)

    arrays, _ = cache.get_or_build(
        lambda: {"token_id_range": np.array(_scan_range(ds), dtype=np.int64)}, is_builder,
        barrier, timeout_s=POLL_TIMEOUT_S, progress=waiting)
    lo, hi = arrays["token_id_range"]
    return int(lo), int(hi)


def check_token_ids(ds: IndexedDataset, vocab_size: int, cache_dir: str,
                    is_builder: bool | None = None, barrier: Callable[[], None] | None = None,
                    group=None) -> int:
    """Raise :class:`~megazero.config.ConfigError` when ``ds`` holds an id outside
    ``0 .. vocab_size-1``; returns the largest id."""
    from megazero.config import ConfigError

    low, top = token_id_range(ds, cache_dir, is_builder, barrier, group)
    if low < 0:
        raise ConfigError(
            f"--data-path {ds.path_prefix}: {data_file_path(ds.path_prefix)} holds token id "
            f"{low}, but token ids run 0..{vocab_size - 1} (the tokenizer / --vocab-size); ids "
            f"{low}..{top} are in the file. It was written by another tool or is damaged: "
            f"preprocess the text again with this run's tokenizer")
    if top >= vocab_size:
        raise ConfigError(
            f"--data-path {ds.path_prefix}: {data_file_path(ds.path_prefix)} holds token id "
            f"{top}, but the model's vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1}, "
            f"from the tokenizer / --vocab-size). The data was preprocessed with another "
            f"tokenizer: preprocess it again with this run's tokenizer, or train with the "
            f"tokenizer it was made with (a vocabulary of at least {top + 1} tokens)")
    return top
