"""Tokenise raw documents into Megatron ``.bin``/``.idx`` datasets (``tools/preprocess_data.py``).

Inputs: JSON lines files (``.json``/``.jsonl``: one document per line, text under ``json_keys``),
plain text files (one document per file, or per line / per blank-line paragraph with
``text_mode``), or directories of such files (walked recursively in sorted order). Every json key
``K`` gets its own dataset ``PREFIX_K_document``; plain text goes to ``PREFIX_text_document``.

Records are tokenised by a process pool with order-preserving ``imap``, so the output is the same
for any number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from megazero.data.indexed_dataset import IndexedDatasetBuilder, check_vocab_fits, optimal_dtype
from megazero.data.tokenizers import build_tokenizer

JSON_SUFFIXES = (".json", ".jsonl")
TEXT_MODES = ("file", "line", "paragraph")


class PreprocessError(ValueError):
    """Bad input; the message names the file (and line) and what to do."""


@dataclass(frozen=True)
class Record:
    source: str
    lineno: int  # 1-based line for JSON lines; 0 for a whole text file
    payload: bytes
    is_json: bool


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    skipped_invalid: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)


def list_input_files(inputs: Sequence[str]) -> list[str]:
    files: list[str] = []
    for path in inputs:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in names if not n.startswith(".")]
            files += sorted(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise PreprocessError(f"--input {path!r} does not exist")
    return files


def iter_records(files: Sequence[str], text_mode: str = "file") -> Iterator[Record]:
    """Raw records, undecoded, so that workers do the parsing and errors can name the line."""
    if text_mode not in TEXT_MODES:
        raise PreprocessError(f"--text-mode {text_mode!r}: choose one of {TEXT_MODES}")
    for path in files:
        if path.endswith(JSON_SUFFIXES):
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        yield Record(path, lineno, line, True)
        elif text_mode == "file":
            with open(path, "rb") as f:
                yield Record(path, 0, f.read(), False)
        elif text_mode == "line":
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        yield Record(path, lineno, line.rstrip(b"\r\n"), False)
        else:
            with open(path, "rb") as f:
                chunk: list[bytes] = []
                start = 1
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        if not chunk:
                            start = lineno
                        chunk.append(line)
                    elif chunk:
                        yield Record(path, start, b"".join(chunk).rstrip(b"\r\n"), False)
                        chunk = []
                if chunk:
                    yield Record(path, start, b"".join(chunk).rstrip(b"\r\n"), False)


def record_texts(rec: Record, json_keys: Sequence[str]) -> dict[str, str]:
    """``{key: text}`` of one record; raises :class:`PreprocessError` naming file and line."""
    where = f"{rec.source}:{rec.lineno}" if rec.lineno else rec.source
    try:
        text = rec.payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PreprocessError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not rec.is_json:
        return {"text": text}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise PreprocessError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); fix "
                              "the line or pass --skip-invalid to skip such lines") from None
    if not isinstance(obj, dict):
        raise PreprocessError(f"{where}: expected a JSON object per line, got "
                              f"{type(obj).__name__}")
    out = {}
    for key in json_keys:
        if key not in obj:
            raise PreprocessError(f"{where}: missing JSON key {key!r} (keys present: "
                                  f"{sorted(obj)}); choose keys with --json-keys or pass "
                                  "--skip-invalid")
        if not isinstance(obj[key], str):
            raise PreprocessError(f"{where}: JSON key {key!r} holds a "
                                  f"{type(obj[key]).__name__}, expected a string")
        out[key] = obj[key]
    return out


class Encoder:
    """Turns a record into ``{key: token ids}`` or an error message."""

    def __init__(self, tokenizer_args: dict, json_keys: Sequence[str], append_eod: bool) -> None:
        self.tokenizer = build_tokenizer(**tokenizer_args)
        self.json_keys = list(json_keys)
        self.append_eod = append_eod

    def encode(self, rec: Record) -> tuple[dict[str, np.ndarray] | None, str | None, int]:
        try:
            texts = record_texts(rec, self.json_keys)
        except PreprocessError as e:
            return None, str(e), len(rec.payload)
        out = {}
        for key, text in texts.items():
            ids = self.tokenizer.tokenize(text)
            if self.append_eod:
                ids.append(self.tokenizer.eod)
            out[key] = np.asarray(ids, dtype=np.int32)  # ids < 2**31; halves pool traffic
        return out, None, len(rec.payload)


# One encoder per pool worker process, set by the pool initializer: building a tokenizer per
# record (or pickling one per task) would dominate the run time. The parent never sets it.
_worker_encoder: Encoder | None = None


def _init_worker(tokenizer_args: dict, json_keys: Sequence[str], append_eod: bool) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(tokenizer_args, json_keys, append_eod)


def _encode_in_worker(rec: Record):
    assert _worker_encoder is not None
    return _worker_encoder.encode(rec)


def _pool_context() -> multiprocessing.context.BaseContext:
    """``fork`` where available: workers start in milliseconds and callers need no
    ``if __name__ == "__main__"`` guard (which ``spawn`` requires); ``spawn`` elsewhere."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


class Progress:
    """Plain-text progress lines on stderr, at most one per ``interval_s``."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.start = time.perf_counter()
        self.last = self.start

    def update(self, stats: PreprocessStats, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.interval_s:
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        print(f"processed {stats.documents} documents ({stats.documents / dt:.0f} docs/s, "
              f"{stats.input_bytes / dt / 1e6:.2f} MB/s, {stats.tokens / dt:.0f} tokens/s)",
              file=self.stream, flush=True)


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_args: dict,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               skip_invalid: bool = False, text_mode: str = "file", dtype: str | None = None,
               chunksize: int = 64, progress: Progress | None = None) -> PreprocessStats:
    """Tokenise ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx``; returns statistics.

    Nothing is written under the final names unless the whole run succeeds.
    """
    files = list_input_files(inputs)
    if not files:
        raise PreprocessError(f"no input files found in {list(inputs)}")
    json_keys = list(json_keys)
    if not all(f.endswith(JSON_SUFFIXES) for f in files) and json_keys != ["text"]:
        raise PreprocessError("plain text inputs are stored under the key 'text'; --json-keys "
                              f"{json_keys} only applies to JSON lines inputs")
    tokenizer = build_tokenizer(**tokenizer_args)
    vocab_size = tokenizer.vocab_size
    token_dtype = np.dtype(dtype) if dtype else np.dtype(optimal_dtype(vocab_size))
    check_vocab_fits(vocab_size, token_dtype)
    progress = progress or Progress()
    stats = PreprocessStats()
    t0 = time.perf_counter()
    records = iter_records(files, text_mode)
    with ExitStack() as stack:
        builders = {}
        for key in json_keys:
            prefix = f"{output_prefix}_{key}_document"
            builders[key] = stack.enter_context(IndexedDatasetBuilder(prefix, token_dtype))
        if workers > 1:
            pool = stack.enter_context(_pool_context().Pool(
                workers, initializer=_init_worker,
                initargs=(tokenizer_args, json_keys, append_eod)))
            results = pool.imap(_encode_in_worker, records, chunksize=chunksize)
        else:
            encoder = Encoder(tokenizer_args, json_keys, append_eod)
            results = map(encoder.encode, records)
        for out, error, nbytes in results:
            stats.input_bytes += nbytes
            if error is not None:
                if not skip_invalid:
                    raise PreprocessError(error)
                stats.skipped_invalid += 1
                continue
            for key, ids in out.items():
                builders[key].add_document(ids)
                stats.tokens += len(ids)
            stats.documents += 1
            progress.update(stats)
        if stats.documents == 0:
            raise PreprocessError(f"empty corpus: no documents in {files[:5]}"
                                  + (f" ({stats.skipped_invalid} invalid lines skipped)"
                                     if stats.skipped_invalid else ""))
        for builder in builders.values():
            builder.finalize()
            stats.outputs.append(builder.path_prefix)
    stats.seconds = time.perf_counter() - t0
    progress.update(stats, force=True)
    if stats.skipped_invalid:
        print(f"skipped {stats.skipped_invalid} invalid records", file=progress.stream,
              flush=True)
    return stats
