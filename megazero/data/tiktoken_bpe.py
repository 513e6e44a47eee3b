"""Megatron's ``TikTokenizer``: a tiktoken-format vocabulary (a JSON list of ``{"rank",
"token_bytes" (base64), "token_str"}``) behind ``num_special_tokens`` reserved ids, in pure
Python, or through the ``tiktoken`` package when it is installed (the same ids, faster).

Ids follow Megatron: ``0 .. num_special_tokens - 1`` are the special tokens (``<unk>``, ``<s>``,
``</s>``, ``<mask>``, ``<pad>``, ``<cls>``, ``<sep>``, then ``<SPECIAL_7>``...), the vocabulary's
rank ``r`` is id ``r + num_special_tokens``, and ``</s>`` is the end of document. The text is cut
by Megatron's pre-tokenizer pattern ``v1`` or ``v2`` and each piece's UTF-8 bytes merged as
tiktoken merges them: the adjacent pair whose merge has the lowest rank first, until no merge
applies. Text is encoded as ordinary text (special-token strings in it are not special).

The patterns use ``\\p{..}`` classes, which the standard ``re`` lacks; they are spelled out from
:mod:`unicodedata` once, on first use, as :mod:`megazero.data.gpt2_bpe` does for GPT-2's.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2**17  # Megatron's DEFAULT_TIKTOKEN_MAX_VOCAB
# Unicode White_Space, what \s means to the regex engines tiktoken patterns are written for
_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Megatron's patterns, with \p{X} written {X} (filled with the category's code points) and \s
# written {S}
_V1 = (r"[^\r\n{L}{N}]?+[{L}]+|[{N}]| ?[^{S}{L}{N}]++[\r\n]*|[{S}]*[\r\n]|[{S}]+(?![^{S}])"
       r"|[{S}]+")
_V2 = (r"[^\r\n{L}{N}]?[{Lu}{Lt}{Lm}{Lo}{M}]*[{Ll}{Lm}{Lo}{M}]+"
       r"|[^\r\n{L}{N}]?[{Lu}{Lt}{Lm}{Lo}{M}]+[{Ll}{Lm}{Lo}{M}]*|[{N}]"
       r"| ?[^{S}{L}{N}]+[\r\n/]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")
# the same in the syntax tiktoken (and the ``regex`` module) reads
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@lru_cache(maxsize=1)
def _categories() -> dict[str, str]:
    """Unicode category (``Lu``, ..., and the majors ``L``, ``N``, ``M``) -> a ``re`` class body."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for cp in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(cp))
        for key in (cat, cat[0]):
            spans = ranges.setdefault(key, [])
            if spans and spans[-1][1] == cp - 1:
                spans[-1] = (spans[-1][0], cp)
            else:
                spans.append((cp, cp))
    return {k: "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                       for a, b in v) for k, v in ranges.items()}


@lru_cache(maxsize=2)
def split_pattern(name: str) -> re.Pattern[str]:
    """Megatron's pre-tokenizer pattern ``v1`` or ``v2`` for the standard ``re``."""
    body = {"v1": _V1, "v2": _V2}[name]
    classes = {**_categories(), "S": _WS}
    return re.compile(re.sub(r"\{(\w+)\}", lambda m: classes[m.group(1)], body))


def bpe_merge(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """The ranks ``piece`` encodes to: adjacent parts merged lowest rank first (the leftmost
    of equal ranks), as tiktoken's byte-pair merge."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, where = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, where = r, i
        if best is None:
            break
        parts[where:where + 2] = [parts[where] + parts[where + 1]]
    return [ranks[p] for p in parts]


def read_ranks(path: str, max_tokens: int) -> dict[bytes, int]:
    """The vocabulary file's first ``max_tokens`` tokens, ``bytes -> rank``; the first 256 must
    be the single bytes in order (every text then encodes)."""
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path!r} is not a tiktoken vocabulary (a JSON list of "
                         "{\"rank\", \"token_bytes\", \"token_str\"})")
    ranks: dict[bytes, int] = {}
    for i, e in enumerate(entries[:max_tokens]):
        token = base64.b64decode(e["token_bytes"])
        if e["rank"] != i or (i < 256 and token != bytes([i])):
            raise ValueError(f"{path!r}: entry {i} has rank {e['rank']} and bytes {token!r}; "
                             "ranks must count from 0 and the first 256 be the single bytes")
        ranks[token] = i
    return ranks


class TikTokenizer:
    """Megatron's ``TikTokenizer`` (see the module's doc)."""

    def __init__(self, path: str, pattern: str = "v2", num_special_tokens: int = 1000,
                 vocab_size: int | None = None) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TikTokenizer vocabulary {path!r} not found (pass "
                                    "--tokenizer-model PATH.json)")
        if pattern not in ("v1", "v2"):
            raise ValueError(f"--tiktoken-pattern {pattern!r}: expected v1 or v2")
        if num_special_tokens < len(SPECIAL_TOKENS):
            raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens}: at least "
                             f"{len(SPECIAL_TOKENS)} ({', '.join(SPECIAL_TOKENS)})")
        self.model_file, self.pattern = path, pattern
        self.num_special = num_special_tokens
        limit = (vocab_size or DEFAULT_VOCAB_SIZE) - num_special_tokens
        self.ranks = read_ranks(path, limit)
        self.specials = [*SPECIAL_TOKENS, *(f"<SPECIAL_{i}>" for i in range(
            len(SPECIAL_TOKENS), num_special_tokens))]
        self._bytes = {r: b for b, r in self.ranks.items()}
        self._cache: dict[str, list[int]] = {}
        self._fast = self._tiktoken()

    def _tiktoken(self) -> Any:
        try:
            import tiktoken
        except ImportError:
            return None
        return tiktoken.Encoding(name="megazero", pat_str=TIKTOKEN_PATTERNS[self.pattern],
                                 mergeable_ranks=self.ranks, special_tokens={})

    @property
    def vocab_size(self) -> int:
        return self.num_special + len(self.ranks)

    @property
    def eod(self) -> int:
        return SPECIAL_TOKENS.index("</s>")

    @property
    def bos(self) -> int:
        return SPECIAL_TOKENS.index("<s>")

    def tokenize(self, text: str) -> list[int]:
        if self._fast is not None:
            ranks = self._fast.encode_ordinary(text)
        else:
            ranks = [r for piece in split_pattern(self.pattern).findall(text)
                     for r in self._merge(piece)]
        return [r + self.num_special for r in ranks]

    def _merge(self, piece: str) -> list[int]:
        got = self._cache.get(piece)
        if got is None:
            got = self._cache[piece] = bpe_merge(piece.encode("utf-8"), self.ranks)
        return got

    def detokenize(self, ids: Sequence[int]) -> str:
        out, text = bytearray(), []
        for i in map(int, ids):
            if i < self.num_special:
                text.append(out.decode("utf-8", errors="replace") + self.specials[i])
                out.clear()
            else:
                out += self._bytes[i - self.num_special]
        return "".join(text) + out.decode("utf-8", errors="replace")

