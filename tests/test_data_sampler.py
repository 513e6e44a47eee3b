"""Data-parallel sampler, resume, mock data, and the config -> iterator helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megazero.data.builder import (
    DataConfig,
    build_data_iterator,
    build_train_valid_test_datasets,
    train_valid_test_num_samples,
)
from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.data.mock_dataset import MockGPTDataset
from megazero.data.sampler import MegatronPretrainingSampler
from megazero.errors import ConfigError


def per_rank_batches(total, consumed, mbs, dp, gbs):
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, gbs)) for r in range(dp)]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("mbs,accum", [(1, 1), (2, 3), (3, 2)])
def test_union_over_ranks_is_the_global_batch(dp, mbs, accum):
    gbs = mbs * dp * accum
    total = 10 * gbs + gbs - 1  # a trailing incomplete global batch is dropped
    ranks = per_rank_batches(total, 0, mbs, dp, gbs)
    assert all(len(r) == 10 * accum for r in ranks)
    for b in range(10):
        union = []
        for r in range(dp):
            for micro in ranks[r][b * accum:(b + 1) * accum]:
                assert len(micro) == mbs
                union += micro
        assert sorted(union) == list(range(b * gbs, (b + 1) * gbs))
    # across ranks and batches, no sample twice
    flat = [i for r in ranks for m in r for i in m]
    assert len(flat) == len(set(flat)) == 10 * gbs


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_continues_exactly(dp):
    mbs, gbs, total = 2, 2 * dp * 2, 200
    full = per_rank_batches(total, 0, mbs, dp, gbs)
    steps_done = 3  # global batches before the "checkpoint"
    consumed = steps_done * gbs
    resumed = per_rank_batches(total, consumed, mbs, dp, gbs)
    micro_per_step = gbs // (mbs * dp)
    for r in range(dp):
        assert full[r][steps_done * micro_per_step:] == resumed[r]
    seen_before = {i for r in range(dp) for m in full[r][:steps_done * micro_per_step] for i in m}
    seen_after = {i for r in range(dp) for m in resumed[r] for i in m}
    assert not seen_before & seen_after
    assert seen_before | seen_after == set(range(total // gbs * gbs))


def test_sampler_errors():
    with pytest.raises(ConfigError, match=r"train_batch_size \(--global-batch-size\) 6 is not "
                       r"divisible by .* 2 x data-parallel size 2 = 4; use a multiple of 4"):
        MegatronPretrainingSampler(100, 0, 2, 0, 2, 6)
    with pytest.raises(ValueError, match="consumed_samples 3 is not a multiple"):
        MegatronPretrainingSampler(100, 3, 2, 0, 2, 8)
    with pytest.raises(ValueError, match="dp_rank 2 outside"):
        MegatronPretrainingSampler(100, 0, 2, 2, 2, 8)


def test_mock_dataset_deterministic_and_predictable():
    a = MockGPTDataset(1000, 32, 50, seed=1)
    b = MockGPTDataset(1000, 32, 50, seed=1)
    c = MockGPTDataset(1000, 32, 50, seed=2)
    t = a[7]["tokens"]
    assert t.dtype == np.int64 and t.shape == (33,)
    np.testing.assert_array_equal(t, b[7]["tokens"])
    assert not np.array_equal(t, c[7]["tokens"])
    d = np.diff(t) % 999
    assert len(set(d.tolist())) == 1 and 1 <= d[0] < 8  # constant stride
    assert t.max() < 999  # never the eod id


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    prefixes = []
    for k, offset in enumerate((0, 30000)):
        prefix = str(d / f"c{k}")
        rng = np.random.default_rng(k)
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            for _ in range(100):
                b.add_document(offset + rng.integers(0, 1000, int(rng.integers(5, 60))))
            b.finalize()
        prefixes.append(prefix)
    return str(d), prefixes


def test_blended_iterators_per_rank(two_corpora):
    cache, (a, b) = two_corpora
    cfg = DataConfig(seq_length=16, num_samples=(160, 32, 0),
                     data_path=("0.25", a, "0.75", b), split="90,10,0", seed=3,
                     cache_dir=cache)
    train, valid, test = build_train_valid_test_datasets(cfg)
    assert test is None and len(train) == 160 and len(valid) == 32
    from_b = sum(int(train[i]["tokens"][0] >= 30000) for i in range(160))
    assert from_b == 120  # 0.75 of 160
    dp, mbs, gbs = 2, 4, 16
    batches = [list(build_data_iterator(train, mbs, r, dp, gbs)) for r in range(dp)]
    assert len(batches[0]) == len(batches[1]) == 160 // (mbs * dp)
    for r in range(dp):
        t = batches[r][0]["tokens"]
        assert t.dtype == torch.int64 and t.shape == (mbs, 17)
    # rank 1's second micro-batch is samples 12..15 of the blend
    expected = np.stack([train[i]["tokens"] for i in range(12, 16)])
    np.testing.assert_array_equal(batches[1][1]["tokens"].numpy(), expected)
    # resuming from consumed samples continues the same stream
    resumed = list(build_data_iterator(train, mbs, 1, dp, gbs, consumed_samples=32))
    for x, y in zip(resumed, batches[1][4:]):
        assert torch.equal(x["tokens"], y["tokens"])
    # the cyclic validation iterator wraps around
    it = build_data_iterator(valid, 4, 0, 1, 4, cyclic=True)
    first = [next(it)["tokens"] for _ in range(8)]
    assert torch.equal(first[0], next(it)["tokens"])
    assert not torch.equal(first[0], first[1])


def test_single_path_and_mock_configs(two_corpora):
    cache, (a, _) = two_corpora
    cfg = DataConfig(seq_length=8, num_samples=(20, 0, 0), data_path=(a,), cache_dir=cache)
    train, valid, test = build_train_valid_test_datasets(cfg)
    assert isinstance(train, GPTDataset) and valid is None and test is None
    mock = DataConfig(seq_length=8, num_samples=(20, 4, 4), mock=True, vocab_size=512)
    tr, va, te = build_train_valid_test_datasets(mock)
    assert len(tr) == 20 and len(va) == 4 and len(te) == 4
    assert not np.array_equal(tr[0]["tokens"], va[0]["tokens"])
    batch = next(build_data_iterator(tr, 2))
    assert batch["tokens"].shape == (2, 9)


def test_config_errors(two_corpora, tmp_path):
    cache, (a, _) = two_corpora
    missing = str(tmp_path / "missing_text_document")
    cfg = DataConfig(seq_length=8, num_samples=(20, 0, 0), data_path=(missing,))
    with pytest.raises(FileNotFoundError, match=r"missing_text_document\.bin"):
        build_train_valid_test_datasets(cfg)
    cfg = DataConfig(seq_length=8, num_samples=(20, 5, 0), data_path=(a,), split="100,0,0",
                     cache_dir=cache)
    with pytest.raises(ValueError, match="leaves no valid documents"):
        build_train_valid_test_datasets(cfg)
    with pytest.raises(ValueError, match="no --data-path"):
        DataConfig(seq_length=8, num_samples=(1, 0, 0))
    # evaluations at iterations 50 and 100 and one at the end; no test split in training
    assert train_valid_test_num_samples(100, 8, 50, 5) == (800, 120, 0)
    assert train_valid_test_num_samples(100, 8, 0, 5) == (800, 40, 0)  # only the final one
    assert train_valid_test_num_samples(100, 8, 50, 0) == (800, 0, 0)


def test_training_run_builds_the_sample_counts_of_train_valid_test_num_samples():
    from megazero.config import load_config
    from megazero.training.builders import Batching, build_datasets

    cfg = load_config(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                       "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                       "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size",
                       "4", "--train-iters", "10", "--eval-interval", "4", "--eval-iters", "3"],
                      world_size=1)
    train, valid = build_datasets(cfg, Batching.from_config(cfg, 1))
    # 10 iterations x 4 samples; evaluations at 4, 8 and the end: 3 x 3 x 4
    assert (len(train), len(valid)) == (40, 36)
    assert (len(train), len(valid), 0) == train_valid_test_num_samples(10, 4, 4, 3)
