"""Blending index, --data-path parsing and --split document ranges."""

from __future__ import annotations

import time

import numpy as np
import pytest

from megazero.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    parse_data_path,
    sizes_needed,
)
from megazero.data.split import parse_split, split_document_ranges


def megatron_greedy_reference(weights, n):
    """Megatron's sequential rule: pick the dataset furthest behind ``w_k * max(i, 1)``."""
    counts = np.zeros(len(weights))
    out = []
    for i in range(n):
        err = np.asarray(weights) * max(i, 1) - counts
        k = int(np.argmax(err))
        out.append(k)
        counts[k] += 1
    return np.array(out)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.1, 0.2, 0.3, 0.4],
                                     [0.97, 0.01, 0.02], [1.0]])
def test_every_prefix_tracks_the_weights(weights):
    n = 20000
    dataset_index, sample_index = build_blending_indices(weights, n)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    w = np.asarray(weights) / sum(weights)
    onehot = np.eye(len(w), dtype=np.int64)[dataset_index]
    counts = np.cumsum(onehot, axis=0)  # counts[m-1, k]: picks of k among the first m
    m = np.arange(1, n + 1)[:, None]
    err = np.abs(counts - w[None, :] * m)
    bound = np.maximum(1.0, len(w) * w) + 1e-9
    assert np.all(err <= bound[None, :])
    # final fractions within ~1/n of the weights
    np.testing.assert_allclose(counts[-1] / n, w, atol=len(w) / n)
    # each dataset's samples are taken in order 0, 1, 2, ...
    for k in range(len(w)):
        picks = sample_index[dataset_index == k]
        np.testing.assert_array_equal(picks, np.arange(len(picks)))


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.9, 0.1], [0.1, 0.9],
                                     [1 / 3, 2 / 3], [0.618, 0.382], [0.07, 0.93]])
def test_two_datasets_match_megatron_greedy_exactly(weights):
    ours, _ = build_blending_indices(weights, 5000)
    np.testing.assert_array_equal(ours, megatron_greedy_reference(weights, 5000))


@pytest.mark.parametrize("weights", [[0.2, 0.35, 0.45], [0.1, 0.2, 0.3, 0.4],
                                     [0.5, 0.25, 0.125, 0.125]])
def test_more_datasets_stay_within_one_sample_of_megatron(weights):
    n = 5000
    ours, _ = build_blending_indices(weights, n)
    ref = megatron_greedy_reference(weights, n)
    eye = np.eye(len(weights))
    ours_c = np.cumsum(eye[ours], axis=0)
    ref_c = np.cumsum(eye[ref], axis=0)
    assert np.abs(ours_c - ref_c).max() <= 1


def test_blending_is_deterministic_and_fast():
    a = build_blending_indices([0.3, 0.7], 1_000_000)
    t0 = time.process_time()  # CPU time: wall time on a shared CI machine is not the code's
    b = build_blending_indices([0.3, 0.7], 1_000_000)
    elapsed = time.process_time() - t0
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert np.bincount(a[0]).tolist() == [300000, 700000]
    assert elapsed < 1.0


def test_zero_weight_dataset_is_never_used():
    idx, _ = build_blending_indices([0.5, 0.0, 0.5], 1000)
    assert np.bincount(idx, minlength=3).tolist() == [500, 0, 500]


class _Const:
    def __init__(self, value, n):
        self.value, self.n = value, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": np.array([self.value, i])}


def test_blended_dataset_serves_by_index():
    weights = [0.25, 0.75]
    need = sizes_needed(weights, 100)
    assert need == [25, 75]
    blend = BlendedDataset([_Const(0, 25), _Const(1, 75)], weights, 100)
    seen = {0: [], 1: []}
    for i in range(len(blend)):
        s = blend[i]
        assert s["dataset_id"] == s["tokens"][0]
        seen[s["dataset_id"]].append(int(s["tokens"][1]))
    assert seen == {0: list(range(25)), 1: list(range(75))}
    with pytest.raises(ValueError, match="has 10 samples but the blend needs 25"):
        BlendedDataset([_Const(0, 10), _Const(1, 75)], weights, 100)


def test_parse_data_path():
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == [(0.3, "A"), (0.7, "B")]
    assert parse_data_path(["3", "A", "1", "B"]) == [(0.75, "A"), (0.25, "B")]
    assert parse_data_path(["A"]) == [(1.0, "A")]
    assert parse_data_path(["A", "B"]) == [(0.5, "A"), (0.5, "B")]
    with pytest.raises(ValueError, match="odd number"):
        parse_data_path(["0.3", "A", "0.7"])
    with pytest.raises(ValueError, match="mix of weights and prefixes"):
        parse_data_path(["A", "0.5", "B"])
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_data_path(["-1", "A"])
    with pytest.raises(ValueError, match="empty"):
        parse_data_path([])


def test_split_ranges_megatron_rounding():
    # 969,30,1 of 1000 documents
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    # rounding surplus moves to the first split: round(.333*10)=3 three times -> 9, shift by -1
    assert split_document_ranges("1,1,1", 10) == [(0, 4), (4, 7), (7, 10)]
    # deficit: round(0.5*3)=2 (banker's rounding gives 2), round(0.25*3)=1 twice -> 4, shift 1
    assert split_document_ranges("2,1,1", 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_document_ranges("100,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_document_ranges("0.9/0.1", 100) == [(0, 90), (90, 100), (100, 100)]
    assert parse_split("98,2") == [0.98, 0.02, 0.0]
    with pytest.raises(ValueError, match="--split 'a,b'"):
        parse_split("a,b")
    with pytest.raises(ValueError, match="positive sum"):
        parse_split("0,0,0")
