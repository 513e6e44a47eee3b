"""Megatron-compatible memory-mapped indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Byte layout of the ``.idx`` file (little endian), identical to Megatron-LM's ``MMapIndexedDataset``
so corpora preprocessed by either tool can be read by both::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    int64     version, always 1
    uint8     dtype code of the tokens in the .bin (see ``DTYPE_CODES``)
    int64     sequence count S
    int64     document count D (= number of documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence byte offsets into the .bin
    int64[D]  document indices: sequence index where each document starts, then S

Megatron may append one int8 "mode" per sequence (multimodal data); such files are accepted and the
modes ignored. The ``.bin`` file is the concatenation of all sequences' tokens.

With one sequence per document (what ``tools/preprocess_data.py`` writes), sequence ``i`` is
document ``i``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np

from megazero.errors import MegazeroError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, two counts = 34

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexFormatError(MegazeroError, ValueError):
    """An ``.idx``/``.bin`` pair that is not a valid Megatron mmap indexed dataset."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def dtype_code(dtype: type[np.number] | np.dtype) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        raise ValueError(f"dtype {dt} has no Megatron dtype code; use one of "
                         f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
    return _CODE_OF_DTYPE[dt]


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Token dtype for a vocabulary: uint16 below 65500 ids (Megatron's threshold), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def check_vocab_fits(vocab_size: int, dtype: type[np.number] | np.dtype) -> None:
    """Raise if token ids ``0 .. vocab_size-1`` cannot be stored in ``dtype``."""
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise ValueError(f"token dtype must be an integer type, got {dt}")
    if vocab_size - 1 > np.iinfo(dt).max:
        raise ValueError(f"vocabulary of {vocab_size} tokens does not fit in {dt} "
                         f"(largest id {np.iinfo(dt).max}); use int32")


def _missing_files_error(prefix: str) -> FileNotFoundError:
    files = (data_file_path(prefix), index_file_path(prefix))
    missing = [p for p in files if not os.path.isfile(p)]
    return FileNotFoundError(
        f"dataset prefix {prefix!r} not found: expected files {data_file_path(prefix)!r} and "
        f"{index_file_path(prefix)!r}; missing: {', '.join(repr(m) for m in missing)}. "
        "Pass the prefix without the .bin/.idx suffix, e.g. my-corpus_text_document."
    )


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair; every item is a zero-copy numpy view of the
    mapped ``.bin``. With ``mmap=False`` (Megatron's ``--no-mmap-bin-files``, for file systems
    where mapping large files is slow or refused) each item is read from the file instead."""

    def __init__(self, path_prefix: str, mmap: bool = True) -> None:
        if path_prefix.endswith((".bin", ".idx")) and not dataset_exists(path_prefix):
            path_prefix = path_prefix[:-4]
        if not dataset_exists(path_prefix):
            raise _missing_files_error(path_prefix)
        self.path_prefix = path_prefix
        self.mmap = mmap
        idx_path = index_file_path(path_prefix)
        bin_path = data_file_path(path_prefix)

        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise IndexFormatError(f"{idx_path}: truncated header ({len(header)} bytes, "
                                   f"expected at least {HEADER_SIZE})")
        if header[:9] != INDEX_MAGIC:
            raise IndexFormatError(f"{idx_path}: bad magic {header[:9]!r}, expected "
                                   f"{INDEX_MAGIC!r} (not a Megatron mmap indexed dataset)")
        version, code, seq_count, doc_count = struct.unpack("<QBQQ", header[9:])
        if version != INDEX_VERSION:
            raise IndexFormatError(f"{idx_path}: unsupported version {version}, expected "
                                   f"{INDEX_VERSION}")
        if code not in DTYPE_CODES:
            raise IndexFormatError(f"{idx_path}: unknown dtype code {code}; known codes: "
                                   f"{sorted(DTYPE_CODES)}")
        self.dtype: type[np.number] = DTYPE_CODES[code]
        self.sequence_count = int(seq_count)
        expected = HEADER_SIZE + 4 * seq_count + 8 * seq_count + 8 * doc_count
        # Megatron's multimodal variant appends one int8 mode per sequence; tolerate it.
        if idx_size not in (expected, expected + seq_count):
            what = "truncated" if idx_size < expected else "has trailing bytes"
            raise IndexFormatError(
                f"{idx_path}: {what}: header promises {seq_count} sequences and {doc_count} "
                f"document indices ({expected} bytes) but the file has {idx_size} bytes")

        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, seq_count, off)
        off += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, seq_count, off)
        off += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._idx_map, np.int64, doc_count, off)
        self._validate(idx_path, bin_path)

        bin_size = os.path.getsize(bin_path)
        self._bin_path = bin_path
        self._bin_map: np.ndarray | None = None
        if bin_size == 0:  # np.memmap refuses empty files
            self._bin_map = np.zeros(0, dtype=np.uint8)
        elif mmap:
            self._bin_map = np.memmap(bin_path, mode="r", dtype=np.uint8)

    def _validate(self, idx_path: str, bin_path: str) -> None:
        """Cheap vectorised consistency checks so a damaged pair fails here, not mid-training."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        docs = self.document_indices
        itemsize = np.dtype(self.dtype).itemsize
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths):
            first = int(docs[0]) if len(docs) else None
            last = int(docs[-1]) if len(docs) else None
            raise IndexFormatError(
                f"{idx_path}: document indices must start at 0 and end at the sequence count "
                f"{len(lengths)}, got first={first} last={last}")
        if np.any(np.diff(docs) < 0):
            raise IndexFormatError(f"{idx_path}: document indices are not non-decreasing")
        if np.any(lengths < 0):
            raise IndexFormatError(f"{idx_path}: negative sequence length")
        total_bytes = int(lengths.sum(dtype=np.int64)) * itemsize
        bin_size = os.path.getsize(bin_path)
        if len(lengths):
            ends = pointers + lengths.astype(np.int64) * itemsize
            if pointers[0] != 0 or np.any(pointers[1:] != ends[:-1]):
                raise IndexFormatError(f"{idx_path}: sequence pointers are not contiguous byte "
                                       "offsets of the sequence lengths")
        if bin_size != total_bytes:
            raise IndexFormatError(
                f"{bin_path} does not match {idx_path}: the index describes {total_bytes} bytes "
                f"({total_bytes // itemsize} tokens of {np.dtype(self.dtype)}) but the .bin has "
                f"{bin_size} bytes")

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return self.sequence_count

    def __getstate__(self) -> dict:
        """Pickle the path only: a memmap would otherwise be pickled as a full in-memory copy
        (e.g. when a spawn-started DataLoader worker receives the dataset)."""
        return {"path_prefix": self.path_prefix, "mmap": self.mmap}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"], state.get("mmap", True))

    def read_tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens from token ``start`` of the ``.bin`` (a view when mapped, else read
        from the file)."""
        itemsize = np.dtype(self.dtype).itemsize
        if self._bin_map is not None:
            return np.frombuffer(self._bin_map, dtype=self.dtype, count=count,
                                 offset=start * itemsize)
        with open(self._bin_path, "rb") as f:
            f.seek(start * itemsize)
            out = np.frombuffer(f.read(count * itemsize), dtype=self.dtype)
        if len(out) != count:
            raise IndexFormatError(f"{self._bin_path}: ends before token {start + count}")
        return out

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` as a read-only view."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"slice [{offset}, {offset + length}) out of sequence {idx} of "
                             f"length {seq_len}")
        itemsize = np.dtype(self.dtype).itemsize
        return self.read_tokens(int(self.sequence_pointers[idx]) // itemsize + offset, length)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences")
        return self.get(idx)


class IndexedDatasetBuilder:
    """Write a ``.bin``/``.idx`` pair; nothing appears under the final names until ``finalize``.

    Tokens are streamed to ``PREFIX.bin.tmp-<pid>``; ``finalize`` writes the index to a temporary
    name too, then renames the ``.bin`` and ``.idx`` into place (``os.replace`` is atomic on
    POSIX). ``abort`` (also called when the ``with`` block raises, Ctrl-C included) deletes the
    temporary files, so an interrupted run leaves no half-written dataset.
    """

    def __init__(self, path_prefix: str, dtype: type[np.number] = np.int32,
                 vocab_size: int | None = None) -> None:
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        if vocab_size is not None:
            check_vocab_fits(vocab_size, self.dtype)
        self._limit = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None
        self.path_prefix = path_prefix
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = data_file_path(path_prefix) + suffix
        self._idx_tmp = index_file_path(path_prefix) + suffix
        os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        self._done = False

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and self._limit is not None:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi > self._limit:
                bad = hi if hi > self._limit else lo
                raise ValueError(f"token id {bad} does not fit in {self.dtype} (range 0.."
                                 f"{self._limit}); the vocabulary is larger than the dtype can "
                                 "hold, use int32")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        self.add_item(tokens)
        self.end_document()

    @property
    def num_documents(self) -> int:
        return len(self._doc_indices) - 1

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._doc_indices[-1] != len(self._lengths):
            self.end_document()  # sequences added without a closing end_document
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            self.abort()
            raise ValueError("a sequence is longer than 2**31-1 tokens; split it")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<QBQQ", INDEX_VERSION, self._code, len(lengths),
                                len(self._doc_indices)))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self._doc_indices, dtype=np.int64).tobytes())
        os.replace(self._bin_tmp, data_file_path(self.path_prefix))
        os.replace(self._idx_tmp, index_file_path(self.path_prefix))
        self._done = True

    def abort(self) -> None:
        """Close and delete the temporary files (idempotent)."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)
        self._done = True
