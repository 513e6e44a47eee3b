"""Hugging Face directories through the convert.py plug-ins (tools/checkpoint/loader_hf.py and
saver_hf.py): an HF directory -> megazero -> HF directory loads in transformers with the same
logits (1e-5 relative, as in test_hf_convert) and a tokenizer that encodes like megazero's;
a directory without tokenizer files converts the weights alone and says so."""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from megazero.testing.hf_models import build, write_bpe_files

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools", "checkpoint")


def plugin(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def logits(model, vocab):
    toks = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return model(toks).logits


def test_gpt2_dir_round_trip_with_bpe_tokenizer(tmp_path):
    import transformers

    from megazero.data.tokenizers import build_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    os.makedirs(src)
    _, _, vocab = write_bpe_files(str(src))
    hf = build("gpt2", vocab_size=vocab, initializer_range=0.3)
    hf.save_pretrained(src)
    model_config, state, tok = plugin("loader_hf").load(SimpleNamespace(load_dir=str(src)))
    assert model_config["openai_gelu"] and model_config["vocab_size"] == vocab
    assert tok["tokenizer_type"] == "GPT2BPETokenizer"
    files = plugin("saver_hf").save(SimpleNamespace(save_dir=str(out)), model_config, state, tok)
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= set(files)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref, got = logits(hf, vocab), logits(back, vocab)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    mz_tok = build_tokenizer("GPT2BPETokenizer", vocab_file=tok["vocab_file"],
                             merge_file=tok["merge_file"])
    text = "hello world, hello there"
    assert hf_tok(text)["input_ids"] == mz_tok.tokenize(text)


def test_llama_export_with_sentencepiece_tokenizer(tmp_path):
    import transformers

    from megazero.config import ModelConfig
    from megazero.convert import model_global_state
    from megazero.data.tokenizers import SentencePieceTokenizer, train_sentencepiece
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    words = "the quick brown fox jumps over a lazy dog while hello world".split()
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (16,), generator=g))
             for _ in range(100)]
    sp = train_sentencepiece(texts, str(tmp_path / "sp"), 300)
    mc = ModelConfig.preset("llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=96, seq_length=32,
                            vocab_size=300, init_method_std=0.1)
    topo = ParallelTopology.single()
    model = GPTModel(mc, topo, seed=2).eval()
    run_config = {"model": dict(vars(mc)), "data": {"tokenizer_type": "SentencePieceTokenizer",
                                                   "tokenizer_model": sp}}
    out = tmp_path / "hf"
    plugin("saver_hf").save(SimpleNamespace(save_dir=str(out)), run_config,
                            model_global_state(model, topo), None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    toks = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(toks)[..., :300]
    got = hf(toks).logits.detach()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "hello world the lazy fox"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == \
        SentencePieceTokenizer(sp).tokenize(text)


def test_directory_without_tokenizer_converts_weights_alone(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    build("llama").save_pretrained(src)
    model_config, state, tok = plugin("loader_hf").load(SimpleNamespace(load_dir=str(src)))
    assert tok is None and "weights alone" in capsys.readouterr().err
    files = plugin("saver_hf").save(SimpleNamespace(save_dir=str(out)), model_config, state, tok)
    assert sorted(files) == ["config.json", "generation_config.json", "model.safetensors"]
    assert "weights alone" in capsys.readouterr().err


def test_missing_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        plugin("loader_hf").load(SimpleNamespace(load_dir=str(tmp_path)))


def test_hf_to_megazero_checkpoint_to_generate_text_and_back(tmp_path, capsys):
    """HF dir -> convert.py --loader hf --saver megazero -> tools/generate_text.py ids equal
    transformers' greedy generate; convert.py --loader megazero --saver hf gives bitwise the
    original weights back, with the tokenizer."""
    import json

    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    os.makedirs(src)
    _, _, vocab = write_bpe_files(str(src))
    hf = build("gpt2", vocab_size=vocab, initializer_range=0.3)
    hf.save_pretrained(src)
    convert = plugin("convert")
    assert convert.main(["--loader", "hf", "--saver", "megazero", "--load-dir", str(src),
                         "--save-dir", str(ckpt)]) == 0
    capsys.readouterr()  # what convert.py printed

    spec = importlib.util.spec_from_file_location(
        "generate_text", os.path.join(TOOLS, "..", "generate_text.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--load", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8",
               "--no-stop-at-eod", "--json"])
    got = json.loads(capsys.readouterr().out)["output_ids"]
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=8)
    assert got == ref[0].tolist()

    assert convert.main(["--loader", "megazero", "--saver", "hf", "--load-dir", str(ckpt),
                         "--save-dir", str(out)]) == 0
    from megazero.convert.hf_files import read_hf_dir

    _, written = read_hf_dir(str(out))
    original = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(written) == set(original)
    assert all(torch.equal(written[k], v) for k, v in original.items())
    assert os.path.isfile(out / "vocab.json")  # the tokenizer came through the run config
