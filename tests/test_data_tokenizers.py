"""Tokenizers: GPT-2 byte-level BPE on a hand-made vocabulary, SentencePiece, Null."""

from __future__ import annotations

import json

import pytest

from megazero.data.gpt2_bpe import _SPLIT, EOD_TOKEN, GPT2BPETokenizer, bytes_to_unicode
from megazero.data.tokenizers import (
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)

MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
          ("Ġw", "or"), ("l", "d"), ("Ġ", "h")]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    symbols = list(bytes_to_unicode().values())
    symbols += ["".join(m) for m in MERGES] + [EOD_TOKEN]
    vocab = {s: i for i, s in enumerate(symbols)}
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    merges = "#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in MERGES) + "\n"
    (d / "merges.txt").write_text(merges, encoding="utf-8")
    return str(d / "vocab.json"), str(d / "merges.txt"), vocab


def test_byte_table_is_a_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_split_pattern_like_gpt2():
    assert _SPLIT.findall("I'm here, it's 2024!") == ["I", "'m", " here", ",", " it", "'s",
                                                     " 2024", "!"]
    # runs of whitespace leave their last character to the next word, as in GPT-2
    assert _SPLIT.findall("a  b\n\nc_d") == ["a", " ", " b", "\n", "\n", "c", "_", "d"]


def test_bpe_applies_merges_by_rank(bpe_files):
    vocab_file, merge_file, vocab = bpe_files
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    assert tok.vocab_size == 256 + len(MERGES) + 1 and tok.eod == vocab[EOD_TOKEN]
    ids = tok.tokenize("hello world")
    assert [tok.decoder[i] for i in ids] == ["hello", "Ġwor", "ld"]
    assert ids == [vocab["hello"], vocab["Ġwor"], vocab["ld"]]
    # (Ġ,h) is the leftmost pair but has the worst rank: (h,e), (l,l), ... are merged first
    assert [tok.decoder[i] for i in tok.tokenize(" hello")] == ["Ġ", "hello"]
    assert [tok.decoder[i] for i in tok.tokenize(" hat")] == ["Ġh", "a", "t"]
    assert tok.detokenize(ids + [tok.eod]) == "hello world" + EOD_TOKEN


def test_bpe_round_trips_any_text_and_caches(bpe_files):
    vocab_file, merge_file, _ = bpe_files
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    text = "naïve café 東京 🙂 __init__ 3.14\n\ttabs  and   spaces \r\n² end "
    assert tok.detokenize(tok.tokenize(text)) == text
    tok.tokenize("hello hello hello")
    assert tok._bpe.cache_info().hits >= 1


def test_bpe_rejects_non_byte_level_vocab(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, EOD_TOKEN: 1}))
    (tmp_path / "m.txt").write_text("")
    with pytest.raises(ValueError, match="byte symbols are missing"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.txt"))
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "nope.txt"))


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 100 and tok.eod == 99
    assert tok.tokenize("1 2 3") == [1, 2, 3] and tok.detokenize([4, 5]) == "4 5"
    with pytest.raises(ValueError, match="outside vocabulary of 100"):
        tok.tokenize("100")


def test_sentencepiece_train_and_use(tmp_path):
    words = ["river", "stone", "bright", "quiet", "morning", "forest", "signal", "paper"]
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(30)) for i in range(60)]
    model = train_sentencepiece(texts, str(tmp_path / "sp"), vocab_size=320)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert isinstance(tok, SentencePieceTokenizer)
    alias = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert alias.tokenize("paper signal") == tok.tokenize("paper signal")
    assert tok.vocab_size == 320 and tok.eod == 2
    ids = tok.tokenize("quiet forest morning")
    assert len(ids) <= 6 and max(ids) < 320
    assert tok.detokenize(ids) == "quiet forest morning"
    # byte fallback: unseen characters survive
    assert tok.detokenize(tok.tokenize("Zürich ☃")) == "Zürich ☃"
    with pytest.raises(ValueError, match="empty corpus"):
        train_sentencepiece(["", "  "], str(tmp_path / "e"), vocab_size=300)


def test_build_tokenizer_errors():
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="v.json")
    with pytest.raises(ValueError, match="unknown tokenizer type 'Foo'"):
        build_tokenizer("Foo")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model="nope.model")
