"""Index cache built once under torch.distributed (gloo ranks), and per-rank data iterators."""

from __future__ import annotations

import pickle

import numpy as np

from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megazero.testing import run_distributed


def _rank_fn(rank: int, world_size: int, prefix: str, cache: str) -> dict:
    import torch.distributed as dist

    from megazero.data.builder import DataConfig, build_data_iterator
    from megazero.data.builder import build_train_valid_test_datasets as build

    cfg = DataConfig(seq_length=8, num_samples=(64, 0, 0), data_path=(prefix,), split="1",
                     seed=11, cache_dir=cache)
    train, _, _ = build(cfg)  # rank 0 builds, the barrier holds rank 1 until the files exist
    it = build_data_iterator(train, 2, rank, world_size, 8, num_samples=64)
    batches = [b["tokens"].numpy() for b in it]
    dist.barrier()
    return {"built": train.built_anew, "shuffle": np.asarray(train.shuffle_index).tolist(),
            "batches": batches}


def test_rank0_builds_under_torch_distributed(tmp_path):
    prefix = str(tmp_path / "c")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(50):
            b.add_document(rng.integers(0, 500, int(rng.integers(3, 30))))
        b.finalize()
    out = run_distributed(_rank_fn, 2, prefix, str(tmp_path / "cache"), timeout=120)
    assert [o["built"] for o in out] == [True, False]
    assert out[0]["shuffle"] == out[1]["shuffle"]
    # each global batch of 8 = rank 0's micro-batches + rank 1's, in sample order 0..7, 8..15
    assert len(out[0]["batches"]) == len(out[1]["batches"]) == 64 // 4
    from megazero.data.gpt_dataset import GPTDataset

    ds = GPTDataset(IndexedDataset(prefix), (0, 50), 8, 64, seed=11, split="train",
                    cache_dir=str(tmp_path / "cache"))
    assert not ds.built_anew
    for step in range(4):
        r0 = out[0]["batches"][step]
        r1 = out[1]["batches"][step]
        expected = np.stack([ds[i]["tokens"] for i in range(4 * step, 4 * step + 4)])
        np.testing.assert_array_equal(np.concatenate([r0, r1]), expected)


def test_indexed_dataset_pickles_by_path(tmp_path):
    prefix = str(tmp_path / "p")
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        b.add_document(np.arange(100000) % 1000)
        b.finalize()
    ds = IndexedDataset(prefix)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the path, not the tokens
    np.testing.assert_array_equal(pickle.loads(blob)[0], ds[0])


def _slow_scan_world(rank: int, world_size: int, prefix: str, cache: str, seconds: float):
    import time

    from megazero.data import token_range
    from megazero.data.builder import DataConfig
    from megazero.data.builder import build_train_valid_test_datasets as build

    scan = token_range._scan_range

    def slow_scan(ds):  # a large corpus: the scan takes longer than a collective may wait
        time.sleep(seconds)
        return scan(ds)

    token_range._scan_range = slow_scan
    cfg = DataConfig(seq_length=8, num_samples=(64, 0, 0), data_path=(prefix,), split="1",
                     seed=11, cache_dir=cache, vocab_size=500)
    train, _, _ = build(cfg)
    ds = IndexedDataset(prefix)
    return token_range.token_id_range(ds, cache), len(train)


def test_first_run_token_scan_keeps_the_other_ranks_out_of_a_collective(tmp_path):
    """Rank 0 scans the .bin for token ids while rank 1 waits outside any collective: under the
    NCCL rules (a blocking collective may wait at most 1 s here; the scan takes 3 s) the world
    passes, and both ranks read the same range."""
    prefix = str(tmp_path / "c")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(50):
            b.add_document(rng.integers(3, 500, int(rng.integers(3, 30))))
        b.finalize()
    tokens = IndexedDataset(prefix)
    every = np.concatenate([tokens.get(i) for i in range(len(tokens))])
    out = run_distributed(_slow_scan_world, 2, prefix, str(tmp_path / "cache"), 3.0,
                          timeout=120, nccl_rules=True, nccl_wait_limit=1.0)
    assert out[0] == out[1] and out[0][0] == (0, int(every.max())) and out[0][1] >= 64
