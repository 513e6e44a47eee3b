"""The three index arrays of a GPT dataset, built with numpy only (no per-sample Python loop).

* document index: the order documents are read in, ``num_epochs`` shuffled copies of the
  document ids, one per epoch.
* sample index: ``[num_samples + 1, 2]`` rows ``(position in document index, token offset)``
  where sample ``i`` starts; sample ``i`` spans up to where sample ``i + 1`` starts, plus one
  token, so consecutive samples share one token (the last target of one is the first input of
  the next) exactly as in Megatron's ``build_sample_idx``.
* shuffle index: the order samples are served in.

Sample ``i`` starts at token ``i * seq_length`` of the stream of documents in document-index
order, so its row is found with a ``searchsorted`` on the cumulative document lengths. This gives
the rows Megatron's C++ loop gives for the same document index.
"""

from __future__ import annotations

import numpy as np


def tokens_per_epoch(sequence_lengths: np.ndarray, documents: np.ndarray) -> int:
    return int(np.sum(sequence_lengths[documents], dtype=np.int64))


def num_epochs_needed(tokens_in_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Fewest epochs holding ``num_samples`` samples of ``seq_length + 1`` overlapping tokens."""
    if tokens_in_epoch <= 1:
        raise ValueError(f"the documents hold {tokens_in_epoch} tokens; a GPT sample needs at "
                         "least 2")
    if num_samples is None:
        return 1
    tokens_needed = num_samples * seq_length + 1
    return max(1, -(-tokens_needed // tokens_in_epoch))


def samples_in(num_tokens: int, seq_length: int) -> int:
    """Full samples in a stream of ``num_tokens`` tokens (the last partial one is dropped)."""
    return max(0, (num_tokens - 1) // seq_length)


def build_document_index(documents: np.ndarray, num_epochs: int,
                         rng: np.random.RandomState) -> np.ndarray:
    """Each epoch is its own permutation of ``documents``.

    Megatron shuffles all epochs' copies together, so one document can be read twice before
    another is read once; shuffling per epoch keeps every epoch a full pass.
    """
    documents = np.asarray(documents, dtype=np.int32)
    out = np.empty(num_epochs * len(documents), dtype=np.int32)
    for e in range(num_epochs):  # loop over epochs only; each is one vectorised permutation
        out[e * len(documents):(e + 1) * len(documents)] = rng.permutation(documents)
    return out


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """Rows ``(document-index position, offset)`` for sample starts ``0, s, 2s, ...``.

    Uses ``side="right"`` so a start that falls on a document boundary points at the next
    non-empty document with offset 0, as Megatron's loop does (zero-length documents are skipped).
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = samples_in(total, seq_length)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, starts, side="right")
    doc_begin = ends[doc_pos] - lengths[doc_pos]
    index_dtype = np.int32 if total < np.iinfo(np.int32).max else np.int64
    sample_index = np.empty((num_samples + 1, 2), dtype=index_dtype)
    sample_index[:, 0] = doc_pos
    sample_index[:, 1] = starts - doc_begin
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int | None, seed: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle index for ``num_samples`` samples (``None``: one epoch).

    When the last epoch is only partly used (under 80% of its samples, Megatron's threshold), its
    samples are shuffled apart from the others so that the requested samples come from the full
    epochs plus a uniform part of the last one, not a random subset of every epoch.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    documents = np.asarray(documents)
    n_tokens = tokens_per_epoch(sequence_lengths, documents)
    num_epochs = num_epochs_needed(n_tokens, seq_length, num_samples)
    separate_final_epoch = False
    samples_before_final = 0
    if num_epochs > 1 and num_samples is not None:
        samples_before_final = samples_in((num_epochs - 1) * n_tokens, seq_length)
        per_epoch = samples_in(n_tokens, seq_length)
        separate_final_epoch = (num_samples - samples_before_final) < int(0.8 * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    total = sample_index.shape[0] - 1
    if num_samples is not None and total < num_samples:
        raise ValueError(f"built {total} samples but {num_samples} were requested")
    first = samples_before_final if separate_final_epoch else total
    shuffle_index = build_shuffle_index(first, total, rng)
    return document_index, sample_index, shuffle_index
