"""Megatron mmap indexed dataset: byte layout, round trip, and damaged-file errors."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megazero.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexFormatError,
    optimal_dtype,
)

MAGIC = b"MMIDIDX\x00\x00"


def expected_index_bytes(lengths: list[int], itemsize: int, code: int,
                         doc_indices: list[int]) -> bytes:
    """The .idx bytes as Megatron lays them out, built without the writer."""
    out = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    ptr = 0
    for n in lengths:
        out += struct.pack("<q", ptr)
        ptr += n * itemsize
    out += b"".join(struct.pack("<q", d) for d in doc_indices)
    return out


def write_docs(prefix: str, docs: list[list[int]], dtype=np.uint16) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()


DOCS = [[5, 6, 7], [1], [], [65000, 0, 2, 9, 9], [3, 3]]


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5),
                                        (np.uint8, 1)])
def test_writer_bytes_match_megatron_layout(tmp_path, dtype, code):
    docs = [[d % 256 for d in doc] for doc in DOCS] if dtype == np.uint8 else DOCS
    prefix = str(tmp_path / "c")
    write_docs(prefix, docs, dtype)
    itemsize = np.dtype(dtype).itemsize
    lengths = [len(d) for d in docs]
    assert open(prefix + ".idx", "rb").read() == expected_index_bytes(
        lengths, itemsize, code, [0, 1, 2, 3, 4, 5])
    fmt = {1: "B", 4: "i", 5: "q", 8: "H"}[code]
    expected_bin = b"".join(struct.pack("<" + fmt, t) for d in docs for t in d)
    assert open(prefix + ".bin", "rb").read() == expected_bin


def test_round_trip_token_for_token(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, int(rng.integers(0, 300))).tolist() for _ in range(500)]
    prefix = str(tmp_path / "rt")
    write_docs(prefix, docs)
    ds = IndexedDataset(prefix)
    assert len(ds) == 500 and ds.num_documents == 500 and ds.dtype == np.uint16
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(501))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds.get(3, offset=2, length=4).tolist() == docs[3][2:6]
    assert [x.tolist() for x in ds[10:13]] == docs[10:13]
    assert ds[-1].tolist() == docs[-1]
    # zero copy: items are read-only views into the memory map
    assert not ds[0].flags.writeable and not ds[0].flags.owndata


def test_reads_hand_built_megatron_files(tmp_path):
    """A pair written byte by byte as Megatron does, with sentence-level sequences (two
    sequences in the first document) and the multimodal modes tail."""
    seqs = [[11, 12], [13], [21, 22, 23]]
    idx = expected_index_bytes([2, 1, 3], 4, 4, [0, 2, 3]) + bytes([0, 0, 1])
    prefix = str(tmp_path / "meg")
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(b"".join(struct.pack("<i", t) for s in seqs for t in s))
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.document_indices.tolist() == [0, 2, 3]


def test_multi_sequence_documents_with_end_document(tmp_path):
    prefix = str(tmp_path / "s")
    with IndexedDatasetBuilder(prefix, np.int32) as b:
        b.add_item([1, 2])
        b.add_item([3])
        b.end_document()
        b.add_item([4])
        b.end_document()
        b.finalize()
    assert open(prefix + ".idx", "rb").read() == expected_index_bytes([2, 1, 1], 4, 4, [0, 2, 3])


def test_optimal_dtype_threshold():
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_abort_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_token_too_large_for_dtype(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "v"), np.uint16) as b:
        with pytest.raises(ValueError, match=r"token id 70000 does not fit in uint16"):
            b.add_document([1, 70000])
    with pytest.raises(ValueError, match=r"vocabulary of 70000 tokens does not fit in uint16"):
        IndexedDatasetBuilder(str(tmp_path / "w"), np.uint16, vocab_size=70000)
    assert os.listdir(tmp_path) == []


@pytest.fixture()
def good_pair(tmp_path):
    prefix = str(tmp_path / "g")
    write_docs(prefix, DOCS)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_prefix_names_expected_files(tmp_path):
    prefix = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert prefix + ".bin" in msg and prefix + ".idx" in msg and "not found" in msg


def test_bad_magic(good_pair):
    _patch(good_pair + ".idx", 0, b"XXXXXXXX\x00")
    with pytest.raises(IndexFormatError, match=r"g\.idx: bad magic .*MMIDIDX"):
        IndexedDataset(good_pair)


def test_bad_version(good_pair):
    _patch(good_pair + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(IndexFormatError, match=r"g\.idx: unsupported version 2, expected 1"):
        IndexedDataset(good_pair)


def test_unknown_dtype_code(good_pair):
    _patch(good_pair + ".idx", 17, bytes([9]))
    with pytest.raises(IndexFormatError, match=r"g\.idx: unknown dtype code 9"):
        IndexedDataset(good_pair)


def test_truncated_index(good_pair):
    size = os.path.getsize(good_pair + ".idx")
    os.truncate(good_pair + ".idx", size - 8)
    with pytest.raises(IndexFormatError, match=r"g\.idx: truncated: header promises 5 sequences"):
        IndexedDataset(good_pair)
    os.truncate(good_pair + ".idx", 20)
    with pytest.raises(IndexFormatError, match=r"g\.idx: truncated header \(20 bytes"):
        IndexedDataset(good_pair)


def test_bin_does_not_match_index(good_pair):
    total = sum(len(d) for d in DOCS)
    os.truncate(good_pair + ".bin", (total - 1) * 2)
    with pytest.raises(IndexFormatError) as e:
        IndexedDataset(good_pair)
    msg = str(e.value)
    assert "g.bin does not match" in msg and f"describes {total * 2} bytes" in msg
    assert f"has {(total - 1) * 2} bytes" in msg


def test_idx_of_another_dataset(tmp_path, good_pair):
    """An .idx copied from a different corpus is caught by the size check."""
    other = str(tmp_path / "o")
    write_docs(other, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    os.replace(other + ".idx", good_pair + ".idx")
    with pytest.raises(IndexFormatError, match="does not match"):
        IndexedDataset(good_pair)


def test_bad_document_indices(good_pair):
    # document_indices start after header(34) + 5 int32 + 5 int64
    _patch(good_pair + ".idx", 34 + 20 + 40, struct.pack("<q", 1))
    with pytest.raises(IndexFormatError, match="document indices must start at 0"):
        IndexedDataset(good_pair)
