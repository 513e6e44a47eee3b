"""Byte-level BPE (GPT-2 style) from ``vocab.json`` and ``merges.txt``, in pure Python.

Text is split into words by a regular expression, each word's UTF-8 bytes are mapped to printable
unicode characters (so the vocabulary never holds raw control bytes), and the merges are applied in
rank order. Any string round-trips, because every byte has a single-character token.

GPT-2's split pattern uses ``\\p{L}``/``\\p{N}`` (Unicode letters and numbers) and ``\\s`` (Unicode
White_Space) of the third-party ``regex`` module; the standard ``re`` has none of them, so the
classes are spelled out from :mod:`unicodedata` once, on first use. Then the words are GPT-2's and
Hugging Face's (``'x²'`` is ``'x'``, ``'²'``, not one word), and an exported tokenizer gives the
ids training saw.
"""

from __future__ import annotations

import json
import os
import re
import sys
import unicodedata
from collections.abc import Sequence
from functools import lru_cache

# Unicode White_Space (what \s means to ``regex`` and to Rust's regex; ``re``'s \s also takes
# the separators U+001C-U+001F), as the body of a ``re`` character class.
_WHITE_SPACE = (r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f"
                r"\u3000")


def _class_of(major: str) -> str:
    """A ``re`` character-class body matching the code points of Unicode category ``major*``."""
    parts, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp))[0] == major
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            a, b = re.escape(chr(start)), re.escape(chr(cp - 1))
            parts.append(a if start == cp - 1 else f"{a}-{b}")
            start = None
    return "".join(parts)


@lru_cache(maxsize=1)
def _split_regex() -> re.Pattern[str]:
    letters, numbers = _class_of("L"), _class_of("N")
    s = _WHITE_SPACE
    return re.compile(f"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+"
                      f"| ?[^{s}{letters}{numbers}]+|[{s}]+(?![^{s}])|[{s}]+")


class _Split:
    """GPT-2's word splitter, compiled on first use (building the classes takes ~0.5 s)."""

    def findall(self, text: str) -> list[str]:
        return _split_regex().findall(text)


_SPLIT = _Split()
EOD_TOKEN = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    code points from 256 upward, so that a BPE vocabulary never contains whitespace or controls.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _get_pairs(word: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE; the end-of-document token is ``<|endoftext|>``."""

    def __init__(self, vocab_file: str, merge_file: str, cache_size: int = 65536) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer: {flag} {path!r} not found")
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merges = [tuple(line.split()) for line in lines if line.strip()]
        for n, m in enumerate(merges):
            if len(m) != 2:
                raise ValueError(f"{merge_file}: merge {n + 1} is not a pair of symbols: {m}")
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        missing = [c for c in self.byte_encoder.values() if c not in self.encoder]
        if missing:
            raise ValueError(f"{vocab_file}: {len(missing)} of the 256 byte symbols are missing "
                             "from the vocabulary; it is not a byte-level BPE vocabulary")
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"{vocab_file}: no {EOD_TOKEN!r} token for end of document")
        self._eod = self.encoder[EOD_TOKEN]
        # Per-instance cache (no module-level state): words repeat heavily in natural text.
        self._bpe = lru_cache(maxsize=cache_size)(self._bpe_uncached)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod

    def _bpe_uncached(self, token: str) -> tuple[str, ...]:
        """Merge the symbols of one word, always applying the lowest-ranked adjacent pair."""
        word = tuple(token)
        pairs = _get_pairs(word)
        while pairs:
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            first, second = best
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
            if len(word) == 1:
                break
            pairs = _get_pairs(word)
        return word

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPLIT.findall(text):
            symbols = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for sym in self._bpe(symbols):
                if sym not in self.encoder:
                    raise ValueError(f"BPE symbol {sym!r} produced by the merges is not in the "
                                     "vocabulary (vocab.json and merges.txt do not match)")
                ids.append(self.encoder[sym])
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
