"""Tokenizer files for tests, trained on the spot: a tiktoken-format vocabulary (byte-level BPE
merges learned from a text, as Megatron's ``TikTokenizer`` reads them) and a SentencePiece model
with Llama 2's special ids (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2)."""

from __future__ import annotations

import base64
import json
import os
from collections import Counter


def write_tiktoken_vocab(path: str, text: str, merges: int = 64, pattern: str = "v2") -> str:
    """Learn ``merges`` byte-pair merges from ``text`` (cut by Megatron's ``pattern``) and
    write them after the 256 single bytes as ``[{"rank", "token_bytes", "token_str"}]``."""
    from megazero.data.tiktoken_bpe import bpe_merge, split_pattern

    ranks = {bytes([i]): i for i in range(256)}
    pieces = Counter(p.encode("utf-8") for p in split_pattern(pattern).findall(text))
    for _ in range(merges):
        pairs: Counter[bytes] = Counter()
        for piece, n in pieces.items():
            ids = bpe_merge(piece, ranks)
            parts = [next(b for b, r in ranks.items() if r == i) for i in ids]
            for a, b in zip(parts, parts[1:]):
                pairs[a + b] += n
        if not pairs:
            break
        ranks[pairs.most_common(1)[0][0]] = len(ranks)
    entries = [{"rank": r, "token_bytes": base64.b64encode(b).decode("ascii"),
                "token_str": b.decode("utf-8", errors="replace")} for b, r in ranks.items()]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return path


def write_llama2_sentencepiece(prefix: str, texts: list[str], vocab_size: int = 300) -> str:
    """A SentencePiece BPE model with Llama 2's ids (unk 0, bos 1, eos 2, no pad) and byte
    fallback; returns the ``.model`` path."""
    from megazero.data.tokenizers import train_sentencepiece

    return train_sentencepiece(texts, prefix, vocab_size)
