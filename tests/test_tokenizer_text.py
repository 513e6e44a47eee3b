"""Tokenizers keep every character, and the exported Hugging Face tokenizer gives training's ids.

For the demo corpus (a few files), the test corpora and a Unicode sample, decode(encode(text))
== text for the SentencePiece models megazero trains (tools/train_tokenizer.py, the demo), and
``AutoTokenizer`` on the ``--saver hf`` output gives the ids training saw, for SentencePiece
(default and the old NFKC/whitespace-folding settings), GPT-2 BPE and tokenizer.json; config.json
and generation_config.json name the tokenizer's bos/eos/pad ids; ``--loader hf`` reads it back.
"""

import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

from megazero.data.demo import demo_files
from megazero.data.tokenizers import SentencePieceTokenizer, build_tokenizer, train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNICODE = ["def f(x):\n    return x\n", "café ½ ﬁ", "naïve Ångström Straße",
           "日本語のテキスト、中文",
           "emoji 😀🎉👩‍💻", "tab\tseparated\tvalues", "windows\r\nline\r\nends\r\n",
           "runs   of    spaces  ", "   leading spaces", "\n\nblank lines\n\n\n", " ", "",
           "digits 1234567 3.14159", "literal </s> and <s> and <0x0A>", "x²³ a½b ①② Ⅻ",
           "separators\x1c\x1d a\u3000b\xa0c"]
WORDS = ["river", "stone", "bright", "quiet", "morning", "forest", "signal", "paper"]
TEST_CORPUS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(30)) for i in range(60)]
TEST_CORPUS += [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}"
                for i in range(60)]


def load_tool(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3],
                                                  os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus():
    files = demo_files()[:6]
    return [open(f, encoding="utf-8").read() for f in files]


@pytest.fixture(scope="module")
def samples(corpus):
    return corpus[:3] + TEST_CORPUS[:5] + TEST_CORPUS[-5:] + UNICODE


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus):
    """Models trained as the tool and the demo train them, plus the old lossy settings."""
    d = tmp_path_factory.mktemp("sp")
    src = d / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus + TEST_CORPUS))
    tool = load_tool("tools/train_tokenizer.py")
    assert tool.main(["--input", str(src), "--output-prefix", str(d / "tool"),
                      "--vocab-size", "1000", "--threads", "1"]) == 0
    assert tool.main(["--input", str(src), "--output-prefix", str(d / "old"), "--vocab-size",
                      "1000", "--threads", "1", "--normalization", "nmt_nfkc",
                      "--remove-extra-whitespaces"]) == 0
    from megazero.data.demo import _tokenizer_texts

    demo = train_sentencepiece(_tokenizer_texts(demo_files(), 300_000), str(d / "demo"), 800,
                               max_sentence_length=8192)
    return {"tool": str(d / "tool.model"), "demo": demo, "old": str(d / "old.model")}


@pytest.mark.parametrize("which", ["tool", "demo"])
def test_every_character_survives(models, samples, which):
    tok = SentencePieceTokenizer(models[which])
    for text in samples:
        assert tok.detokenize(tok.tokenize(text)) == text, repr(text[:60])
    assert tok.tokenize("a\nb") != tok.tokenize("a b")


def test_old_settings_only_on_request(models):
    old = SentencePieceTokenizer(models["old"])
    assert old.detokenize(old.tokenize("def f(x):\n    return x\n")) == "def f(x): return x"
    assert old.detokenize(old.tokenize("café ½ ﬁ")) == "café 1⁄2 fi"


def test_demo_cache_is_keyed_by_tokenizer_settings(monkeypatch):
    import megazero.data.tokenizers as tokenizers
    from megazero.data.demo import _cache_key

    files = demo_files()[:3]
    key = _cache_key(files, 2048)
    real = tokenizers.sentencepiece_text_options
    monkeypatch.setattr(tokenizers, "sentencepiece_text_options",
                        lambda: {**real(), "remove_extra_whitespaces": True})
    assert _cache_key(files, 2048) != key


def export(info, out):
    """convert.py --saver hf's tokenizer path, through the saver plug-in with a tiny model."""
    from megazero.config import ModelConfig
    from megazero.convert import model_global_state
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    vocab = build_tokenizer(**info).vocab_size
    mc = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                     vocab_size=vocab)
    topo = ParallelTopology.single()
    state = model_global_state(GPTModel(mc, topo, seed=0), topo)
    saver = load_tool("tools/checkpoint/saver_hf.py")
    saver.save(SimpleNamespace(save_dir=str(out)), {"model": dict(vars(mc)), "data": info},
               state, None)


def assert_same_ids(out, mz, samples):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text in samples:
        assert hf(text)["input_ids"] == mz.tokenize(text), repr(text[:60])
        assert hf.decode(mz.tokenize(text)) == mz.detokenize(mz.tokenize(text))


@pytest.mark.parametrize("which", ["tool", "demo", "old"])
def test_exported_sentencepiece_gives_training_ids(models, samples, tmp_path, which):
    info = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": models[which]}
    export(info, tmp_path)
    mz = SentencePieceTokenizer(models[which])
    assert_same_ids(tmp_path, mz, samples)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((tmp_path / name).read_text())
        assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2) == (1, mz.eod), name
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] is None
    assert json.loads((tmp_path / "generation_config.json").read_text())["pad_token_id"] == 2
    loader = load_tool("tools/checkpoint/loader_hf.py")
    _, _, back = loader.load(SimpleNamespace(load_dir=str(tmp_path)))
    again = build_tokenizer(**back)
    assert [again.tokenize(t) for t in samples] == [mz.tokenize(t) for t in samples]


def test_exported_gpt2_bpe_and_tokenizer_json_give_training_ids(tmp_path, samples):
    from megazero.testing.hf_models import write_bpe_files

    vocab, merges, n = write_bpe_files(str(tmp_path))
    info = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}
    export(info, tmp_path / "gpt2")
    mz = build_tokenizer(**info)
    assert_same_ids(tmp_path / "gpt2", mz, samples)
    cfg = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == mz.eod == n - 1 != 50256

    # a tokenizer.json whose post-processor adds a BOS: megazero trained without it
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tmp_path / "gpt2" / "tokenizer.json"))
    eod = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{eod} $A",
                                                       special_tokens=[(eod, mz.eod)])
    os.makedirs(tmp_path / "src")
    tok.save(str(tmp_path / "src" / "tokenizer.json"))
    info = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tmp_path / "src")}
    export(info, tmp_path / "json")
    assert_same_ids(tmp_path / "json", build_tokenizer(**info), samples)


def test_gpt2_words_are_hugging_faces(samples):
    """megazero's GPT-2 BPE splits text into the words GPT-2 and HF's ByteLevel split it into,
    so a real GPT-2 vocabulary (whose merges cross no word) gives the same ids in both."""
    from tokenizers import pre_tokenizers

    from megazero.data.gpt2_bpe import _SPLIT, bytes_to_unicode

    hf = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    table = bytes_to_unicode()
    for text in samples:
        mine = ["".join(table[b] for b in w.encode()) for w in _SPLIT.findall(text)]
        assert mine == [w for w, _ in hf.pre_tokenize_str(text)], repr(text[:60])


def test_weights_alone_name_no_special_ids(tmp_path):
    from megazero.convert.hf_tokenizer import export_tokenizer

    assert export_tokenizer(None, str(tmp_path)).eos_token_id is None
    assert not os.listdir(tmp_path)
