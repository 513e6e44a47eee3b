"""--tokenizer-type HuggingFaceTokenizer: a local tokenizer.json (or its directory) tokenizes as
transformers' fast tokenizer does, preprocesses a corpus and trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megazero.config import ConfigError
from megazero.data.tokenizers import HuggingFaceTokenizer, build_tokenizer
from megazero.testing.launch import check, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(60)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(d / "tokenizer.json"))
    return d


def test_matches_transformers_fast_tokenizer(hf_dir):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_dir))
    text = "the lazy fox, 123 jumps"
    assert tok.tokenize(text) == ref.encode(text, add_special_tokens=False)
    assert tok.detokenize(tok.tokenize(text)) == text == ref.decode(tok.tokenize(text))
    assert tok.eod == ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.vocab_size == len(ref)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HuggingFaceTokenizer(str(hf_dir / "nope"))


def test_preprocess_and_train(hf_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(corpus), "--output-prefix", str(tmp_path / "c"),
                           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                           str(hf_dir / "tokenizer.json"), "--append-eod"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = check(run_training([
        "--data-path", str(tmp_path / "c_text_document"), "--tokenizer-type",
        "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir), "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
        "--eval-iters", "0", "--split", "100,0,0", "--distributed-backend", "gloo"]))
    assert "iteration        2/       2" in out
    assert "HuggingFaceTokenizer" in out


def test_missing_model_flag_is_a_clear_error():
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    assert issubclass(ConfigError, ValueError)
