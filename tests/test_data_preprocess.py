"""tools/preprocess_data.py and tools/train_tokenizer.py end to end, with bad inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import struct

import numpy as np
import pytest

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.preprocess import PreprocessError, preprocess
from megazero.data.tokenizers import SentencePieceTokenizer, train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["amber", "bridge", "cloud", "delta", "ember", "falcon", "garden", "harbor", "island",
         "jungle", "kettle", "lantern", "meadow", "nectar", "orbit", "pepper", "quartz"]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(1, 40)))) + "." for _ in range(n)]


def write_jsonl(path, texts, extra=None) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            rec = {"text": t, "id": i}
            if extra:
                rec.update(extra(i))
            f.write(json.dumps(rec) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return train_sentencepiece(make_texts(300, seed=1), str(d / "tok"), vocab_size=400)


def sp_args(model: str) -> dict:
    return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model}


def test_end_to_end_workers_identical(tmp_path, sp_model, capsys):
    texts = make_texts(120)
    src = write_jsonl(tmp_path / "in.jsonl", texts, extra=lambda i: {"title": f"doc {i}"})
    tool = _load_tool("preprocess_data")
    for w in (1, 2):
        rc = tool.main(["--input", src, "--output-prefix", str(tmp_path / f"w{w}"),
                        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                        sp_model, "--append-eod", "--workers", str(w), "--chunk-size", "7",
                        "--json-keys", "text", "title"])
        assert rc == 0
    err = capsys.readouterr().err
    assert "docs/s" in err and "MB/s" in err and "120 documents" in err
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            a = open(tmp_path / f"w1_{key}_document{ext}", "rb").read()
            b = open(tmp_path / f"w2_{key}_document{ext}", "rb").read()
            assert a == b
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(str(tmp_path / "w2_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == 120
    for i, t in enumerate(texts):
        assert ds[i].tolist() == tok.tokenize(t) + [tok.eod]
    titles = IndexedDataset(str(tmp_path / "w1_title_document"))
    assert titles[5].tolist() == tok.tokenize("doc 5") + [tok.eod]
    header = open(tmp_path / "w1_text_document.idx", "rb").read(34)
    assert header == b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 120, 121)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["in.jsonl"] + [f"w{w}_{k}_document{e}" for w in (1, 2) for k in ("text", "title")
                        for e in (".bin", ".idx")])


def test_malformed_line_names_file_and_line_and_writes_nothing(tmp_path, sp_model):
    src = write_jsonl(tmp_path / "bad.jsonl", make_texts(10))
    lines = open(src).read().splitlines()
    lines[6] = '{"text": "unterminated'
    open(src, "w").write("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    for workers in (1, 2):
        with pytest.raises(PreprocessError, match=r"bad\.jsonl:7: malformed JSON"):
            preprocess([src], str(out / "x"), sp_args(sp_model), workers=workers)
        assert os.listdir(out) == []  # no partial or temporary files


def test_skip_invalid_counts_and_reports(tmp_path, sp_model, capsys):
    texts = make_texts(20)
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    lines = open(src).read().splitlines()
    lines[3] = "not json"
    lines[11] = json.dumps({"body": "no text key"})
    open(src, "w").write("\n".join(lines) + "\n\n")  # trailing blank line is ignored
    tool = _load_tool("preprocess_data")
    rc = tool.main(["--input", src, "--output-prefix", str(tmp_path / "s"),
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
                    "--skip-invalid"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "skipped 2 invalid records" in err and "18 documents" in err
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(str(tmp_path / "s_text_document"))
    kept = [t for i, t in enumerate(texts) if i not in (3, 11)]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) for t in kept]


def test_missing_key_and_wrong_type(tmp_path, sp_model):
    src = write_jsonl(tmp_path / "k.jsonl", make_texts(3))
    with pytest.raises(PreprocessError, match=r"k\.jsonl:1: missing JSON key 'body' \(keys "
                                              r"present: \['id', 'text'\]\)"):
        preprocess([src], str(tmp_path / "o"), sp_args(sp_model), json_keys=["body"])
    with pytest.raises(PreprocessError, match=r"k\.jsonl:1: JSON key 'id' holds a int"):
        preprocess([src], str(tmp_path / "o"), sp_args(sp_model), json_keys=["id"])


def test_empty_corpus(tmp_path, sp_model):
    src = tmp_path / "empty.jsonl"
    src.write_text("\n\n")
    with pytest.raises(PreprocessError, match="empty corpus"):
        preprocess([str(src)], str(tmp_path / "o"), sp_args(sp_model))
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]
    (tmp_path / "d").mkdir()
    with pytest.raises(PreprocessError, match="no input files"):
        preprocess([str(tmp_path / "d")], str(tmp_path / "o"), sp_args(sp_model))


def test_missing_input_and_cli_error(tmp_path, sp_model, capsys):
    tool = _load_tool("preprocess_data")
    rc = tool.main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                    str(tmp_path / "o"), "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", sp_model])
    assert rc == 1
    assert "nope.jsonl' does not exist" in capsys.readouterr().err


def test_vocab_larger_than_dtype(tmp_path):
    src = tmp_path / "ids.txt"
    src.write_text("1 2 69999 3")
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 70000}
    with pytest.raises(ValueError, match="vocabulary of 70000 tokens does not fit in uint16"):
        preprocess([str(src)], str(tmp_path / "o"), null, dtype="uint16")
    stats = preprocess([str(src)], str(tmp_path / "o"), null, append_eod=True)
    ds = IndexedDataset(stats.outputs[0])
    assert ds.dtype == np.int32 and ds[0].tolist() == [1, 2, 69999, 3, 69999]


def test_text_files_and_directories(tmp_path, sp_model):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("bridge cloud\n\ndelta\n")
    (corpus / "a.txt").write_text("amber\nember\n")
    write_jsonl(corpus / "sub" / "c.jsonl", ["orbit", "quartz"])
    (corpus / ".hidden").write_text("ignored")
    tok = SentencePieceTokenizer(sp_model)
    stats = preprocess([str(corpus)], str(tmp_path / "f"), sp_args(sp_model))
    ds = IndexedDataset(stats.outputs[0])
    expected = ["amber\nember\n", "bridge cloud\n\ndelta\n", "orbit", "quartz"]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) for t in expected]
    stats = preprocess([str(corpus / "b.txt")], str(tmp_path / "p"), sp_args(sp_model),
                       text_mode="paragraph")
    assert [IndexedDataset(stats.outputs[0])[i].tolist() for i in range(2)] == [
        tok.tokenize("bridge cloud"), tok.tokenize("delta")]
    stats = preprocess([str(corpus / "a.txt")], str(tmp_path / "l"), sp_args(sp_model),
                       text_mode="line")
    assert len(IndexedDataset(stats.outputs[0])) == 2


def test_train_tokenizer_tool(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", make_texts(200, seed=3))
    tool = _load_tool("train_tokenizer")
    rc = tool.main(["--input", src, "--output-prefix", str(tmp_path / "tk"),
                    "--vocab-size", "350", "--threads", "1"])
    assert rc == 0
    tok = SentencePieceTokenizer(str(tmp_path / "tk.model"))
    assert tok.vocab_size == 350
    assert tok.detokenize(tok.tokenize("garden lantern")) == "garden lantern"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    assert tool.main(["--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                      "--vocab-size", "300"]) == 1
    assert not os.path.exists(tmp_path / "x.model")


def test_interrupted_run_leaves_no_dataset(tmp_path, sp_model, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", make_texts(50))
    real = SentencePieceTokenizer.tokenize
    calls = {"n": 0}

    def flaky(self, text):
        calls["n"] += 1
        if calls["n"] == 30:
            raise KeyboardInterrupt  # as if Ctrl-C arrived mid-run
        return real(self, text)

    monkeypatch.setattr(SentencePieceTokenizer, "tokenize", flaky)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], str(tmp_path / "out"), sp_args(sp_model))
    assert calls["n"] == 30
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_gpt2_bpe_tokenizer_through_the_tool(tmp_path):
    from megazero.data.gpt2_bpe import EOD_TOKEN, GPT2BPETokenizer, bytes_to_unicode

    symbols = list(bytes_to_unicode().values()) + ["Ġw", "or", "Ġwor", EOD_TOKEN]
    (tmp_path / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ w\no r\nĠw or\n", encoding="utf-8")
    src = write_jsonl(tmp_path / "in.jsonl", ["hello world", "a world of words"])
    tool = _load_tool("preprocess_data")
    rc = tool.main(["--input", src, "--output-prefix", str(tmp_path / "g"), "--tokenizer-type",
                    "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
                    "--merge-file", str(tmp_path / "merges.txt"), "--append-eod",
                    "--workers", "2"])
    assert rc == 0
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    ds = IndexedDataset(str(tmp_path / "g_text_document"))
    assert ds[0].tolist() == tok.tokenize("hello world") + [tok.eod]
    assert tok.detokenize(ds[1][:-1]) == "a world of words"
    assert symbols[int(ds[1][1])] == "Ġwor"


def test_json_keys_do_not_apply_to_plain_text(tmp_path, sp_model):
    (tmp_path / "a.txt").write_text("amber")
    with pytest.raises(PreprocessError, match="--json-keys .* only applies to JSON lines"):
        preprocess([str(tmp_path / "a.txt")], str(tmp_path / "o"), sp_args(sp_model),
                   json_keys=["body"])
