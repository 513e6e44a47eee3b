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

from megazero.data.index_cache import IndexCache, default_barrier, default_is_builder
from megazero.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

_FORMAT = 1
_CHUNK_TOKENS = 1 << 24  # bounded memory for the scan of a large .bin


def _scan_max(ds: IndexedDataset) -> int:
    """Largest token id in ``ds`` (-1 when it holds no tokens), chunk by chunk."""
    total = int(ds.sequence_lengths.sum(dtype=np.int64))
    tokens = np.frombuffer(ds._bin_map, dtype=ds.dtype, count=total) if total else None
    best = -1
    for start in range(0, total, _CHUNK_TOKENS):
        best = max(best, int(tokens[start:start + _CHUNK_TOKENS].max()))
    return best


def max_token_id(ds: IndexedDataset, cache_dir: str, is_builder: bool | None = None,
                 barrier: Callable[[], None] | None = None, group=None) -> int:
    """The largest token id in ``ds``, from the index cache in ``cache_dir`` when present.

    One rank builds (as for the sample indices); the others read its result."""
    prefix = ds.path_prefix
    files = {}
    for kind, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        st = os.stat(path)
        files[kind] = {"path": os.path.abspath(path), "size": st.st_size,
                       "mtime_ns": st.st_mtime_ns}
    cache = IndexCache(cache_dir, {"class": "MaxTokenId", "format": _FORMAT, **files},
                       ["max_token_id"])
    if is_builder is None:
        is_builder = default_is_builder(group)
        if barrier is None:
            barrier = default_barrier(group)
    arrays, _ = cache.get_or_build(
        lambda: {"max_token_id": np.array([_scan_max(ds)], dtype=np.int64)}, is_builder, barrier)
    return int(arrays["max_token_id"][0])


def check_token_ids(ds: IndexedDataset, vocab_size: int, cache_dir: str,
                    is_builder: bool | None = None, barrier: Callable[[], None] | None = None,
                    group=None) -> int:
    """Raise :class:`~megazero.config.ConfigError` when ``ds`` holds an id >= ``vocab_size``;
    returns the largest id."""
    from megazero.config import ConfigError

    top = max_token_id(ds, cache_dir, is_builder, barrier, group)
    if top >= vocab_size:
        raise ConfigError(
            f"--data-path {ds.path_prefix}: {data_file_path(ds.path_prefix)} holds token id "
            f"{top}, but the model's vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1}, "
            f"from the tokenizer / --vocab-size). The data was preprocessed with another "
            f"tokenizer: preprocess it again with this run's tokenizer, or train with the "
            f"tokenizer it was made with (a vocabulary of at least {top + 1} tokens)")
    return top
