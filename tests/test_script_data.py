"""Megatron's data flags of current scripts: each split from its own corpus
(``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``, blended by weight) and
``--no-mmap-bin-files`` (the same samples, read from the files)."""

from __future__ import annotations

import numpy as np

from megazero.data.builder import DataConfig, build_train_valid_test_datasets
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _corpus(path, lo: int, hi: int, docs: int = 40) -> str:
    """Documents of token ids in [lo, hi): which corpus a sample came from is readable."""
    rng = np.random.default_rng(lo)
    with IndexedDatasetBuilder(str(path), np.uint16) as b:
        for _ in range(docs):
            b.add_document(rng.integers(lo, hi, size=int(rng.integers(5, 30))))
        b.finalize()
    return str(path)


def test_each_split_from_its_own_corpus(tmp_path):
    train_a = _corpus(tmp_path / "a", 0, 100)
    train_b = _corpus(tmp_path / "b", 100, 200)
    valid = _corpus(tmp_path / "v", 200, 300)
    cfg = DataConfig(seq_length=8, num_samples=(64, 16, 0), vocab_size=300,
                     cache_dir=str(tmp_path / "cache"),
                     split_paths=(("0.25", train_a, "0.75", train_b), (valid,), ()))
    train, val, test = build_train_valid_test_datasets(cfg)
    assert test is None
    from_b = [int(train[i]["tokens"].min() >= 100) for i in range(len(train))]
    assert 0.6 < np.mean(from_b) < 0.9  # blended 1:3 (a sample may straddle nothing: one corpus)
    assert all(train[i]["tokens"].max() < 200 for i in range(len(train)))
    assert all(val[i]["tokens"].min() >= 200 for i in range(len(val)))
    # no valid corpus: no validation set, as in Megatron
    cfg = DataConfig(seq_length=8, num_samples=(64, 16, 0), vocab_size=300,
                     cache_dir=str(tmp_path / "cache"), split_paths=((train_a,), (), ()))
    assert build_train_valid_test_datasets(cfg)[1] is None


def test_no_mmap_reads_the_same_samples(tmp_path):
    prefix = _corpus(tmp_path / "c", 0, 500)
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    assert read._bin_map is None
    for i in range(len(mapped)):
        assert np.array_equal(mapped[i], read[i])
    assert np.array_equal(mapped.get(3, 2, 4), read.get(3, 2, 4))
    cfg = dict(seq_length=16, num_samples=(32, 0, 0), data_path=(prefix,), vocab_size=500,
               cache_dir=str(tmp_path / "cache"))
    a = build_train_valid_test_datasets(DataConfig(**cfg))[0]
    b = build_train_valid_test_datasets(DataConfig(**cfg, mmap=False))[0]
    assert all(np.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert b.dataset.mmap is False
