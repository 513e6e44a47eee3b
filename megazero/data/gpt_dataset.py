"""GPT pretraining samples over a range of documents of an :class:`IndexedDataset`.

A sample is ``{"tokens": int64[seq_length + 1]}``: the model reads ``tokens[:-1]`` and predicts
``tokens[1:]``. Samples are cut from the stream of documents (one shuffled permutation per
epoch, ``eod`` tokens written by preprocessing separate them) and freely cross document
boundaries; consecutive samples in stream order share one token. ``dataset[i]`` serves stream
sample ``shuffle_index[i]``; ``stream_sample(j)`` reads stream sample ``j`` directly.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np

from megazero.data.index_cache import IndexCache, default_barrier, default_is_builder
from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.sample_index import build_gpt_indices

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
_CACHE_FORMAT = 1  # bump when the index construction changes, to invalidate old caches


def default_cache_dir(path_prefix: str) -> str:
    """``<directory of the data>/index-cache``."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "index-cache")


class GPTDataset:
    """Fixed-length language-model samples with cached, seeded document/sample/shuffle indices.

    Args:
        indexed_dataset: the tokens (one sequence per document, as preprocess_data writes).
        document_range: half-open ``(begin, end)`` range of documents this split uses.
        seq_length: tokens the model reads per sample; samples hold ``seq_length + 1``.
        num_samples: samples wanted; enough epochs are stacked to provide them. ``None``: one
            epoch. ``len(dataset)`` may exceed it (the last epoch is used whole).
        seed: shuffling seed.
        split: name recorded in the cache key (``train``/``valid``/``test``).
        cache_dir: where the ``.npy`` indices live (default :func:`default_cache_dir`).
        is_builder / barrier: who builds a missing cache and how the others wait. With
            ``is_builder=None``: rank 0 of ``group`` builds and (unless a ``barrier`` is given)
            ``torch.distributed.barrier(group)`` syncs when torch.distributed is initialised;
            otherwise this process builds alone. A non-builder with ``barrier=None`` polls for
            the files.
    """

    def __init__(self, indexed_dataset: IndexedDataset, document_range: tuple[int, int],
                 seq_length: int, num_samples: int | None, seed: int = 1234,
                 split: str = "train", cache_dir: str | None = None,
                 is_builder: bool | None = None, barrier: Callable[[], None] | None = None,
                 group=None) -> None:
        self.dataset = indexed_dataset
        n_docs = indexed_dataset.num_documents
        if len(indexed_dataset) != n_docs:
            raise ValueError(f"{indexed_dataset.path_prefix}: GPTDataset needs one sequence per "
                             f"document, found {len(indexed_dataset)} sequences in {n_docs} "
                             "documents (preprocess without sentence splitting)")
        begin, end = document_range
        if not 0 <= begin < end <= n_docs:
            raise ValueError(f"{indexed_dataset.path_prefix}: document range [{begin}, {end}) is "
                             f"empty or outside the {n_docs} documents of the dataset")
        self.document_range = (int(begin), int(end))
        self.seq_length = int(seq_length)
        self.num_samples = num_samples
        self.seed = int(seed)
        self.split = split
        self.cache_dir = cache_dir or default_cache_dir(indexed_dataset.path_prefix)
        self.description = {
            "class": type(self).__name__,
            "format": _CACHE_FORMAT,
            "path_prefix": os.path.abspath(indexed_dataset.path_prefix),
            # The indices depend on the data only through these lengths: hashing them catches a
            # corpus re-preprocessed under the same name.
            "lengths_sha256": hashlib.sha256(np.ascontiguousarray(
                indexed_dataset.sequence_lengths[begin:end]).tobytes()).hexdigest(),
            "document_range": list(self.document_range),
            "seq_length": self.seq_length,
            "num_samples": num_samples,
            "seed": self.seed,
            "split": split,
        }
        cache = IndexCache(self.cache_dir, self.description, INDEX_NAMES)
        if is_builder is None:
            is_builder = default_is_builder(group)
            if barrier is None:
                barrier = default_barrier(group)
        arrays, self.built_anew = cache.get_or_build(self._build, is_builder, barrier)
        self.cache_key = cache.key
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _build(self) -> dict[str, np.ndarray]:
        documents = np.arange(*self.document_range, dtype=np.int64)
        doc_idx, sample_idx, shuffle_idx = build_gpt_indices(
            self.dataset.sequence_lengths, documents, self.seq_length, self.num_samples, self.seed)
        return {"document_index": doc_idx, "sample_index": sample_idx,
                "shuffle_index": shuffle_idx}

    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1)

    def stream_sample(self, j: int) -> np.ndarray:
        """Tokens of sample ``j`` in stream (unshuffled) order, int64[seq_length + 1]."""
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[j], self.sample_index[j + 1]
        doc_beg, off_beg, doc_end, off_end = int(doc_beg), int(off_beg), int(doc_end), int(off_end)
        if doc_beg == doc_end:
            tokens = self.dataset.get(int(self.document_index[doc_beg]), off_beg,
                                      off_end - off_beg + 1)
            return tokens.astype(np.int64)
        parts = [self.dataset.get(int(self.document_index[doc_beg]), off_beg)]
        for pos in range(doc_beg + 1, doc_end):
            parts.append(self.dataset.get(int(self.document_index[pos])))
        parts.append(self.dataset.get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        return {"tokens": self.stream_sample(int(self.shuffle_index[idx]))}
