"""Hugging Face Mixtral <-> megazero MoE: a tiny MixtralForCausalLM made by transformers,
imported with tools/checkpoint/convert.py, generates transformers' greedy tokens with
tools/generate_text.py; exporting it back gives the same logits (transformers loads the
per-expert layout megazero writes) and the same weights."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megazero.convert import ConversionError, hf_to_megazero, megazero_to_hf

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
transformers = pytest.importorskip("transformers")


def _tool(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mixtral(**kw):
    cfg = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, initializer_range=0.2,
        rope_theta=5000.0, **kw)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def test_mixtral_imports_generates_and_exports_the_same_model(tmp_path, capsys):
    hf = _mixtral()
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf.save_pretrained(src)
    convert = _tool("checkpoint/convert.py", "convert")
    assert convert.main(["--loader", "hf", "--saver", "megazero", "--load-dir", str(src),
                         "--save-dir", str(ckpt)]) == 0
    capsys.readouterr()
    gen = _tool("generate_text.py", "generate_text")
    gen.main(["--load", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8",
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
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    toks = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = hf(toks).logits, back(toks).logits
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    for k, v in hf.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_mixtral_config_and_refusals():
    hf = _mixtral()
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    assert (mc.moe.num_experts, mc.moe.moe_router_topk, mc.moe.moe_ffn_hidden_size) == (4, 2, 40)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in state
    cfg, legacy = megazero_to_hf(mc, state)
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in legacy
    # transformers' fused in-memory layout imports the model transformers computes
    from megazero.convert import load_global_state
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    topo = ParallelTopology.single()
    model = GPTModel(mc, topo).eval()
    load_global_state(model, state, topo)
    toks = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = hf(toks).logits, model(toks)[..., :96]
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and the per-expert file layout imports the same weights back
    _, again = hf_to_megazero(cfg, legacy)
    assert set(again) == set(state) and all(torch.equal(again[k], v) for k, v in state.items())
    with pytest.raises(ConversionError, match="router_jitter_noise"):
        hf_to_megazero(_mixtral(router_jitter_noise=0.1).config.to_dict(), hf.state_dict())
    from dataclasses import replace

    sig = replace(mc, moe=replace(mc.moe, moe_router_score_function="sigmoid"))
    with pytest.raises(ConversionError, match="softmax"):
        megazero_to_hf(sig, state)
