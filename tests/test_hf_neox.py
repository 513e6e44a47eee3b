"""The README's demo model shape (RoPE, LayerNorm, GELU, biases, tied head) exports to Hugging
Face as GPT-NeoX: transformers' logits equal megazero's (1e-5 relative) and its greedy
generation equals tools/generate_text.py's; a NeoX directory imports back bitwise; settings
megazero does not compute are refused in one line; files get normal permissions."""

import importlib.util
import json
import os
import stat

import pytest
import torch

from megazero.checkpoint import write_model_state
from megazero.config import ModelConfig
from megazero.convert import ConversionError, hf_to_megazero, megazero_to_hf, model_global_state
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
VOCAB = 96


def tool(name, sub="checkpoint"):
    path = os.path.join(TOOLS, sub, f"{name}.py") if sub else os.path.join(TOOLS, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def demo_shaped(untie=False):
    """The README demo's block at a tiny size: rope, and megazero's defaults otherwise."""
    mc = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                     vocab_size=VOCAB, position_embedding_type="rope", attention_dropout=0.0,
                     hidden_dropout=0.0, init_method_std=0.6,
                     untie_embeddings_and_output_weights=untie)
    topo = ParallelTopology.single()
    model = GPTModel(mc, topo, seed=3).eval()
    with torch.no_grad():  # biases and norms away from 0/1, so a misplaced one shows
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return mc, model, model_global_state(model, topo)


@pytest.mark.parametrize("untie", [False, True])
def test_demo_shape_exports_as_neox_and_generates_the_same(tmp_path, capsys, untie):
    import transformers

    mc, model, state = demo_shaped(untie)
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    write_model_state(str(ckpt), {"model": dict(vars(mc)), "data": {}}, state)
    assert tool("convert").main(["--loader", "megazero", "--saver", "hf", "--load-dir",
                                 str(ckpt), "--save-dir", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt_neox" and cfg["use_parallel_residual"] is False
    assert cfg["tie_word_embeddings"] is (not untie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(toks)[..., :VOCAB]
        got = hf(toks).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()

    capsys.readouterr()
    tool("generate_text", sub=None).main(["--load", str(ckpt), "--prompt-ids", "5,6,7,8",
                                          "--max-new-tokens", "10", "--no-stop-at-eod",
                                          "--json"])
    mine = json.loads(capsys.readouterr().out)["output_ids"]
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert mine == theirs[0].tolist()
    assert len(set(mine[4:])) > 1  # not a degenerate repeat that any model would produce


@pytest.mark.parametrize("rotary_pct", [1.0, 0.25])  # 0.25: Pythia's partial rotary
def test_neox_imports_and_round_trips_bitwise(rotary_pct):
    import transformers

    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=80, max_position_embeddings=32, rotary_pct=rotary_pct,
        rotary_emb_base=5000,
        use_parallel_residual=False, hidden_act="gelu_new", tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    m, state = hf_to_megazero(cfg.to_dict(), hf.state_dict())
    assert m.openai_gelu and m.rotary_base == 5000 and m.ffn_size == 80
    assert m.rotary_percent == rotary_pct
    model = GPTModel(m, ParallelTopology.single(), seed=0).eval()
    model.load_state_dict({**model.state_dict(), **{
        k: torch.cat([v, torch.zeros(model.state_dict()[k].shape[0] - v.shape[0], *v.shape[1:])])
        if v.shape != model.state_dict()[k].shape else v for k, v in state.items()}})
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, got = hf(toks).logits, model(toks)[..., :VOCAB]
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    back_cfg, back = megazero_to_hf(m, state)
    original = hf.state_dict()
    back["lm_head.weight"] = back.pop("embed_out.weight")
    assert set(back) == {k for k in original if not k.endswith("inv_freq")}
    assert all(torch.equal(back[k], original[k]) for k in back)


@pytest.mark.parametrize("override,needle", [
    (dict(use_parallel_residual=True), "use_parallel_residual=True"),
    (dict(rotary_pct=0.3), "rotary_pct=0.3"),
    (dict(hidden_act="relu"), "hidden_act='relu'"),
])
def test_neox_settings_megazero_lacks_are_refused(override, needle):
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=64, rotary_pct=1.0, use_parallel_residual=False)
    cfg = transformers.GPTNeoXConfig(**{**base, **override}).to_dict()
    with pytest.raises(ConversionError, match=needle.replace("(", r"\(")):
        hf_to_megazero(cfg, {})


def test_conversion_error_is_one_line_and_files_are_readable(tmp_path, capsys):
    mc = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                     vocab_size=VOCAB, position_embedding_type="rope", swiglu=True)
    topo = ParallelTopology.single()
    state = model_global_state(GPTModel(mc, topo, seed=0), topo)
    ckpt = tmp_path / "ckpt"
    write_model_state(str(ckpt), {"model": dict(vars(mc)), "data": {}}, state)
    convert = tool("convert")
    rc = convert.main(["--loader", "megazero", "--saver", "hf", "--load-dir", str(ckpt),
                       "--save-dir", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("convert.py: error: cannot convert")
    assert "no HF architecture matches; closest is" in err[0]
    assert not (tmp_path / "bad").exists()

    mc, _, state = demo_shaped()
    write_model_state(str(ckpt), {"model": dict(vars(mc)), "data": {}}, state)
    old = os.umask(0o022)
    try:
        assert convert.main(["--loader", "megazero", "--saver", "hf", "--load-dir", str(ckpt),
                             "--save-dir", str(tmp_path / "ok")]) == 0
    finally:
        os.umask(old)
    for name in os.listdir(tmp_path / "ok"):
        assert stat.S_IMODE(os.stat(tmp_path / "ok" / name).st_mode) == 0o644, name
