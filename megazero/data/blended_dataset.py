"""Weighted blending of several datasets (``--data-path 0.3 A 0.7 B``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def parse_data_path(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """``["0.3", "A", "0.7", "B"]`` -> ``[(0.3, "A"), (0.7, "B")]`` with weights summing to 1.

    A single unweighted prefix (``["A"]``) gets weight 1; several unweighted prefixes
    (``["A", "B"]``) are weighted equally. Mixing both styles is an error.
    """
    items = [s for s in data_path if s.strip()]
    if not items:
        raise ValueError("--data-path is empty: give a prefix, or weight/prefix pairs")

    def _is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not _is_number(items[0]):
        if any(_is_number(s) for s in items):
            raise ValueError(f"--data-path {' '.join(items)}: mix of weights and prefixes; use "
                             "either 'PREFIX ...' or 'W1 PREFIX1 W2 PREFIX2 ...'")
        pairs = [(1.0, p) for p in items]
    else:
        if len(items) % 2:
            raise ValueError(f"--data-path {' '.join(items)}: expected weight/prefix pairs, got an "
                             f"odd number ({len(items)}) of values")
        pairs = []
        for w, p in zip(items[0::2], items[1::2]):
            if not _is_number(w):
                raise ValueError(f"--data-path: expected a weight before {p!r}, got {w!r}")
            weight = float(w)
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"--data-path: weight {w!r} for {p!r} must be >= 0")
            pairs.append((weight, p))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError("--data-path: weights sum to zero")
    return [(w / total, p) for w, p in pairs]


def build_blending_indices(weights: Sequence[float], num_samples: int
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic interleaving: which dataset, and which of its samples, each sample is.

    Returns ``(dataset_index int16[n], dataset_sample_index int64[n])``.

    Megatron picks, sample by sample, the dataset furthest behind its target count
    (``argmax_k w_k * max(i, 1) - count_k``, a sequential C++ loop). Here the ``j``-th sample of
    dataset ``k`` is given the due time ``j / w_k`` and one stable sort merges all datasets by
    due time (ties: the lower dataset first; the first samples, all due at 0, by decreasing
    weight as Megatron's ``max(i, 1)`` orders them). For two datasets this is exactly Megatron's
    sequence, because the two errors always sum to zero so "furthest behind" is "earliest due";
    for more it can differ by one sample at a time. Either way every prefix of ``m`` samples holds
    within ``max(1, K * w_k)`` of ``w_k * m`` samples of dataset ``k`` (K datasets), and 1M samples
    take tens of milliseconds.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blending weights must be non-negative with a positive sum, "
                         f"got {weights}")
    if len(w) > np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended")
    w = w / w.sum()
    if num_samples == 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int64)
    keys, owners = [], []
    for k, wk in enumerate(w):
        if wk == 0:
            continue
        # Enough candidates that the n earliest due times always come from this pool.
        count = int(math.ceil(wk * num_samples + len(w))) + 1
        keys.append(np.arange(count, dtype=np.float64) / wk)
        owners.append(np.full(count, k, dtype=np.int16))
    all_keys = np.concatenate(keys)
    all_owners = np.concatenate(owners)
    tie_break = np.where(all_keys == 0, -w[all_owners], all_owners.astype(np.float64))
    order = np.lexsort((tie_break, all_keys))[:num_samples]
    dataset_index = all_owners[order]
    # Within one dataset the chosen candidates are its first c_k in order, so the sample index of
    # each pick is its rank among earlier picks of the same dataset.
    dataset_sample_index = np.zeros(num_samples, dtype=np.int64)
    for k in np.unique(dataset_index):
        mask = dataset_index == k
        dataset_sample_index[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples from several datasets interleaved by weight; ``blend[i]`` is deterministic.

    ``datasets[k]`` must hold at least as many samples as the blending index draws from it
    (``sizes_needed(weights, n)`` says how many).
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(x) / float(sum(weights)) for x in weights]
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights, num_samples)
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (ds, n) in enumerate(zip(self.datasets, needed)):
            if len(ds) < n:
                raise ValueError(f"blended dataset {k} has {len(ds)} samples but the blend needs "
                                 f"{int(n)}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        k = int(self.dataset_index[idx])
        sample = dict(self.datasets[k][int(self.dataset_sample_index[idx])])
        sample["dataset_id"] = k
        return sample


def sizes_needed(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples each dataset must provide for a blend of ``num_samples``."""
    dataset_index, _ = build_blending_indices(weights, num_samples)
    return [int(c) for c in np.bincount(dataset_index, minlength=len(weights))]
