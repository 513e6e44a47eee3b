"""GPT sample/document/shuffle indices: token coverage, Megatron equivalence, caching."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megazero.data.sample_index import build_gpt_indices, build_sample_index


def megatron_sample_index_reference(sizes, document_index, seq_length):
    """Direct port of the semantics of Megatron's C++ ``build_sample_idx`` loop (drop last
    partial sample, one extra token per sample), for comparison."""
    tokens = int(sum(int(sizes[d]) for d in document_index))
    num_samples = (tokens - 1) // seq_length
    rows = [(0, 0)]
    doc_pos, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[document_index[doc_pos]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc_pos += 1
                offset = 0
        rows.append((doc_pos, offset))
    return np.array(rows)


def make_corpus(prefix: str, n_docs: int, seed: int = 0, max_len: int = 40,
                allow_empty: bool = True):
    rng = np.random.default_rng(seed)
    low = 0 if allow_empty else 1
    docs = []
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for i in range(n_docs):
            # token values encode (document, position) so misplaced tokens are detectable
            n = int(rng.integers(low, max_len))
            doc = (np.arange(n) + 100 * i) % 60000
            docs.append(doc)
            b.add_document(doc)
        b.finalize()
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    prefix = str(d / "corpus")
    docs = make_corpus(prefix, 300)
    return prefix, docs


@pytest.mark.parametrize("seq_length", [1, 3, 7, 16, 64])
def test_sample_index_matches_megatron_loop(seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 30, 200).astype(np.int32)
    sizes[0] = 5  # Megatron's loop assumes the first document is not empty
    doc_index = np.concatenate([np.arange(200), rng.permutation(200)]).astype(np.int32)
    ours = build_sample_index(sizes, doc_index, seq_length)
    ref = megatron_sample_index_reference(sizes, doc_index, seq_length)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("seq_length,num_samples", [(8, 50), (13, 700), (5, 3000)])
def test_samples_tile_the_shuffled_document_stream(tmp_path, corpus, seq_length, num_samples):
    prefix, docs = corpus
    begin, end = 20, 280
    ds = GPTDataset(IndexedDataset(prefix), (begin, end), seq_length, num_samples, seed=7,
                    cache_dir=str(tmp_path))
    assert len(ds) >= num_samples
    # Expected stream: each epoch is a permutation of the range's documents, concatenated.
    n_range = end - begin
    doc_index = np.asarray(ds.document_index)
    assert len(doc_index) % n_range == 0
    for e in range(len(doc_index) // n_range):
        epoch = doc_index[e * n_range:(e + 1) * n_range]
        assert sorted(epoch.tolist()) == list(range(begin, end))
    stream = np.concatenate([docs[d] for d in doc_index]).astype(np.int64)
    samples = [ds.stream_sample(j) for j in range(len(ds))]
    assert all(len(s) == seq_length + 1 for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]  # consecutive samples share one token
    rebuilt = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])
    np.testing.assert_array_equal(rebuilt, stream[:len(rebuilt)])
    assert len(stream) - len(rebuilt) < seq_length  # only the last partial sample is dropped
    # served order is the shuffle of the stream order
    shuffle = np.asarray(ds.shuffle_index)
    assert sorted(shuffle.tolist()) == list(range(len(ds)))
    for i in (0, 1, len(ds) - 1):
        np.testing.assert_array_equal(ds[i]["tokens"], samples[shuffle[i]])
    assert ds[0]["tokens"].dtype == np.int64


def test_same_seed_same_indices_other_seed_differs(tmp_path, corpus):
    prefix, _ = corpus
    idx = IndexedDataset(prefix)
    a = GPTDataset(idx, (0, 300), 16, 500, seed=3, cache_dir=str(tmp_path / "a"))
    b = GPTDataset(idx, (0, 300), 16, 500, seed=3, cache_dir=str(tmp_path / "b"))
    c = GPTDataset(idx, (0, 300), 16, 500, seed=4, cache_dir=str(tmp_path / "c"))
    assert a.built_anew and b.built_anew
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_cache_reused_and_keys_rebuild(tmp_path, corpus):
    prefix, _ = corpus
    idx = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    first = GPTDataset(idx, (0, 250), 16, 400, seed=1, cache_dir=cache)
    assert first.built_anew
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and all(f.startswith(first.cache_key) for f in files)
    mtimes = {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files}
    again = GPTDataset(idx, (0, 250), 16, 400, seed=1, cache_dir=cache)
    assert not again.built_anew and again.cache_key == first.cache_key
    assert {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files} == mtimes
    np.testing.assert_array_equal(again.sample_index, first.sample_index)
    keys = {first.cache_key}
    for kwargs in ({"document_range": (0, 249)}, {"seq_length": 17}, {"num_samples": 401},
                   {"seed": 2}, {"split": "valid"}):
        args = {"document_range": (0, 250), "seq_length": 16, "num_samples": 400, "seed": 1,
                "split": "train"} | kwargs
        ds = GPTDataset(idx, cache_dir=cache, **args)
        assert ds.built_anew, kwargs
        keys.add(ds.cache_key)
    assert len(keys) == 6
    assert len(os.listdir(cache)) == 6 * 4  # no temporary files left behind


def test_default_cache_dir_is_beside_the_data(tmp_path):
    prefix = str(tmp_path / "c")
    make_corpus(prefix, 20, allow_empty=False)
    ds = GPTDataset(IndexedDataset(prefix), (0, 20), 8, 10)
    assert os.path.isdir(tmp_path / "index-cache")
    assert ds.cache_dir == str(tmp_path / "index-cache")


def test_one_rank_builds_the_others_wait(tmp_path, corpus):
    prefix, _ = corpus
    idx = IndexedDataset(prefix)
    world = 3
    barrier = threading.Barrier(world)
    results: dict[int, GPTDataset] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = GPTDataset(idx, (0, 300), 16, 800, seed=5, cache_dir=str(tmp_path),
                                    is_builder=(r == 0), barrier=lambda: barrier.wait(60))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[r].built_anew for r in range(world)] == [True, False, False]
    for r in range(1, world):
        np.testing.assert_array_equal(results[r].shuffle_index, results[0].shuffle_index)


def test_non_builder_without_barrier_polls(tmp_path, corpus):
    prefix, _ = corpus
    idx = IndexedDataset(prefix)
    out: dict[str, GPTDataset] = {}
    waiter = threading.Thread(target=lambda: out.setdefault("w", GPTDataset(
        idx, (0, 300), 16, 100, seed=9, cache_dir=str(tmp_path), is_builder=False)))
    waiter.start()
    builder = GPTDataset(idx, (0, 300), 16, 100, seed=9, cache_dir=str(tmp_path),
                         is_builder=True)
    waiter.join(30)
    assert builder.built_anew and not out["w"].built_anew
    np.testing.assert_array_equal(out["w"].sample_index, builder.sample_index)


def test_partial_final_epoch_is_shuffled_separately():
    sizes = np.full(100, 10, dtype=np.int32)  # 1000 tokens per epoch -> 99 samples of 10
    docs = np.arange(100)
    # 2 epochs hold 199 samples; asking 120 uses only 21 of the second epoch's samples
    doc_idx, sample_idx, shuffle = build_gpt_indices(sizes, docs, 10, 120, seed=0)
    assert len(doc_idx) == 200 and sample_idx.shape == (200, 2)
    before = (1000 - 1) // 10
    assert sorted(shuffle[:before].tolist()) == list(range(before))
    assert sorted(shuffle[before:].tolist()) == list(range(before, 199))
    # asking nearly two full epochs shuffles everything together
    _, _, shuffle = build_gpt_indices(sizes, docs, 10, 190, seed=0)
    assert shuffle[:before].max() >= before


def test_range_and_sequence_errors(tmp_path, corpus):
    prefix, _ = corpus
    idx = IndexedDataset(prefix)
    with pytest.raises(ValueError, match=r"document range \[5, 5\) is empty"):
        GPTDataset(idx, (5, 5), 16, 10, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"outside the 300 documents"):
        GPTDataset(idx, (0, 301), 16, 10, cache_dir=str(tmp_path))


def test_rewritten_corpus_invalidates_cache(tmp_path):
    prefix = str(tmp_path / "c")
    make_corpus(prefix, 50, seed=1, allow_empty=False)
    cache = str(tmp_path / "cache")
    first = GPTDataset(IndexedDataset(prefix), (0, 50), 8, 40, cache_dir=cache)
    # same number of tokens, different document lengths: the old indices would be wrong
    lengths = IndexedDataset(prefix).sequence_lengths.copy()
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        b.add_document(np.zeros(lengths[0] + lengths[1], dtype=np.uint16))
        for n in lengths[2:]:
            b.add_document(np.zeros(n, dtype=np.uint16))
        b.add_document([])
        b.finalize()
    second = GPTDataset(IndexedDataset(prefix), (0, 50), 8, 40, cache_dir=cache)
    assert second.built_anew and second.cache_key != first.cache_key


def test_unwritable_cache_dir_is_named(tmp_path, corpus):
    prefix, _ = corpus
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"cannot write the index cache to .*not-a-dir.*cache_dir"):
        GPTDataset(IndexedDataset(prefix), (0, 300), 16, 10, cache_dir=str(blocker))
