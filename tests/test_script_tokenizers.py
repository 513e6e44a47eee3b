"""Megatron's tokenizer types a launch script names: ``Llama2Tokenizer`` (SentencePiece with
Llama 2's ids, ``<s>`` first), ``TikTokenizer`` (a tiktoken vocabulary behind 1000 special ids,
pattern v1/v2, checked against tiktoken's merge rule by hand), and the Hugging Face export of a
Unigram SentencePiece model with byte fallback (every other export test uses BPE)."""

from __future__ import annotations

import base64
import json

import pytest

from megazero.data.tiktoken_bpe import TikTokenizer, bpe_merge, split_pattern
from megazero.data.tokenizers import (
    Llama2Tokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)
from megazero.testing.tokenizer_files import write_tiktoken_vocab

TEXTS = [f"the river runs by the stone number {i}, quiet and bright; Über café {i * 7}"
         for i in range(200)]
ODD = ["emoji 😀🎉👩‍💻 and 日本語", "tab\tand\nnew lines\r\n", "x²³ ½ Ⅻ", "  spaces   ", ""]


def _vocab(tmp_path, tokens: list[bytes]) -> str:
    entries = [bytes([i]) for i in range(256)] + tokens
    path = tmp_path / "tik.json"
    path.write_text(json.dumps([{"rank": r, "token_bytes": base64.b64encode(b).decode(),
                                 "token_str": b.decode("utf-8", "replace")}
                                for r, b in enumerate(entries)]))
    return str(path)


def test_tiktoken_merges_lowest_rank_first(tmp_path):
    # ranks: "ll" 256, "he" 257, "hell" 258, "o " 259; "hello" merges ll, he, hell; " " alone
    path = _vocab(tmp_path, [b"ll", b"he", b"hell", b"o "])
    tok = TikTokenizer(path, num_special_tokens=1000)
    assert bpe_merge(b"hello", tok.ranks) == [258, ord("o")]
    assert bpe_merge(b"abab", tok.ranks) == [97, 98, 97, 98]
    assert tok.tokenize("hello") == [1258, 1000 + ord("o")]
    # v2 splits "hello world" into "hello", " world": the space stays with the word
    assert split_pattern("v2").findall("hello world") == ["hello", " world"]
    assert split_pattern("v2").findall("Hello WORLD 42") == ["Hello", " WORLD", " ", "4", "2"]
    assert split_pattern("v1").findall("Hello WORLD 42") == ["Hello", " WORLD", " ", "4", "2"]
    assert (tok.eod, tok.bos, tok.vocab_size) == (2, 1, 1000 + 260)
    assert tok.detokenize([1, *tok.tokenize("hello"), 2]) == "<s>hello</s>"


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_round_trips_and_learned_merges_apply(tmp_path, pattern):
    path = write_tiktoken_vocab(str(tmp_path / f"{pattern}.json"), "\n".join(TEXTS), 40, pattern)
    tok = build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern,
                          tiktoken_num_special_tokens=8)
    assert tok.vocab_size == 8 + 256 + 40
    for text in TEXTS[:5] + ODD:
        ids = tok.tokenize(text)
        assert all(8 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # the learned merges shorten the text they were learned on (" the" is one token)
    assert len(tok.tokenize(TEXTS[0])) < len(TEXTS[0].encode()) / 2
    with pytest.raises(ValueError, match="--tiktoken-pattern 'v3'"):
        TikTokenizer(path, pattern="v3")


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory):
    from megazero.data.demo import demo_files

    d = tmp_path_factory.mktemp("sp")
    corpus = TEXTS + [open(f, encoding="utf-8").read() for f in demo_files()[:4]]
    return {kind: train_sentencepiece(corpus, str(d / kind), 600, model_type=kind)
            for kind in ("bpe", "unigram")}


def test_llama2_tokenizer_puts_bos_first(sp_models):
    sp = SentencePieceTokenizer(sp_models["bpe"])
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_models["bpe"])
    assert isinstance(llama, Llama2Tokenizer)
    assert (llama.bos, llama.eod, llama.vocab_size) == (1, 2, sp.vocab_size)
    for text in TEXTS[:3] + ODD:
        assert llama.tokenize(text) == [1, *sp.tokenize(text)]


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_exported_sentencepiece_with_byte_fallback_gives_training_ids(sp_models, tmp_path, kind):
    """``tokenizers`` alone (no transformers): the exported tokenizer.json encodes as the model
    does, characters outside the vocabulary (emoji, CJK) through byte fallback, and the
    Llama2Tokenizer export starts with ``<s>`` as training did."""
    from tokenizers import Tokenizer

    from megazero.convert.hf_tokenizer import export_tokenizer

    for tk in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        out = tmp_path / tk
        export_tokenizer({"tokenizer_type": tk, "tokenizer_model": sp_models[kind]}, str(out))
        hf = Tokenizer.from_file(str(out / "tokenizer.json"))
        mz = build_tokenizer(tk, tokenizer_model=sp_models[kind])
        fallback = 0
        for text in TEXTS[:5] + ODD:
            ids = mz.tokenize(text)
            assert hf.encode(text).ids == ids, (tk, text)
            fallback += sum(1 for i in ids if hf.id_to_token(i).startswith("<0x"))
        assert fallback > 10  # the byte pieces were exercised


def test_mock_data_takes_any_tokenizer_and_its_vocabulary(sp_models, tmp_path):
    """Megatron's mock data with a real tokenizer (its old Mixtral example: Llama2Tokenizer and
    --mock-data): the tokenizer's vocabulary sizes the model and the synthetic tokens."""
    from megazero.config import load_config
    from megazero.training.builders import build_tokenizer_and_data_path

    tik = write_tiktoken_vocab(str(tmp_path / "tik.json"), "\n".join(TEXTS), 16)
    for kind, model, vocab in (("Llama2Tokenizer", sp_models["bpe"], 600),
                               ("TikTokenizer", tik, 1000 + 256 + 16)):
        cfg = load_config(["--mock-data", "--tokenizer-type", kind, "--tokenizer-model", model,
                           "--train-iters", "1"], 1)
        tok, cfg = build_tokenizer_and_data_path(cfg, topo=None)
        assert tok.vocab_size == cfg.model.vocab_size == vocab, kind
