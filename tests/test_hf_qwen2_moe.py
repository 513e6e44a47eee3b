"""Hugging Face Qwen2-MoE and Qwen2 <-> megazero: tiny ``Qwen2MoeForCausalLM`` /
``Qwen2ForCausalLM`` models made by transformers, imported with tools/checkpoint/convert.py,
generate transformers' greedy tokens with tools/generate_text.py; exporting them back gives the
same logits (transformers loads the per-expert layout megazero writes) and the same weights.

The MoE models mix dense and sparse layers (``decoder_sparse_step`` 2, ``mlp_only_layers``),
keep the gated shared expert, and route both ways: ``norm_topk_prob`` False (full-softmax
probabilities of the top k, ``--moe-router-pre-softmax``) and True (renormalised). transformers
initialises biases to zero, so the QKV biases and the norms are perturbed to make them matter.
Tolerance: ``|got - ref| <= 1e-5 * max|ref|`` as in test_hf_convert.py (measured ~1e-6).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

import pytest
import torch

from megazero.convert import ConversionError, hf_to_megazero, load_global_state, megazero_to_hf

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
transformers = pytest.importorskip("transformers")
VOCAB = 96
SPARSE = {False: dict(decoder_sparse_step=2), True: dict(mlp_only_layers=[2])}


def _tool(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _qwen2_moe(norm_topk_prob: bool = False, **kw):
    """3 layers; sparse layers {1} (norm False) or {0, 1} (norm True)."""
    cfg = transformers.Qwen2MoeConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, initializer_range=0.2, rope_theta=5000.0,
        norm_topk_prob=norm_topk_prob, **SPARSE[norm_topk_prob]), **kw})
    torch.manual_seed(0)
    return _perturbed(transformers.Qwen2MoeForCausalLM(cfg))


def _qwen2(**kw):
    cfg = transformers.Qwen2Config(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, rope_theta=5000.0, tie_word_embeddings=True), **kw})
    torch.manual_seed(0)
    return _perturbed(transformers.Qwen2ForCausalLM(cfg))


def _close(got, ref, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err, bound = (got - ref).abs().max().item(), 1e-5 * ref.abs().max().item()
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


CASES = {"moe-pre-softmax": lambda: _qwen2_moe(False), "moe-renormalised": lambda: _qwen2_moe(True),
         "dense-tied": _qwen2}


@pytest.mark.parametrize("case", list(CASES))
def test_imports_generates_and_exports_the_same_model(case, tmp_path, capsys):
    hf = CASES[case]()
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
    assert type(back) is type(hf)
    if case != "dense-tied":
        assert back.config.norm_topk_prob == hf.config.norm_topk_prob
        assert [type(layer.mlp).__name__ for layer in back.model.layers] == [
            type(layer.mlp).__name__ for layer in hf.model.layers]
    toks = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(back(toks).logits, hf(toks).logits, f"{case} exported logits")
    theirs = back.state_dict()
    assert set(theirs) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert torch.equal(theirs[k], v), k


def _megazero_logits(mc, state, toks):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    topo = ParallelTopology.single()
    model = GPTModel(mc, topo).eval()
    load_global_state(model, state, topo)
    with torch.no_grad():
        return model(toks)[..., :VOCAB]


def test_qwen2_moe_config_layouts_and_refusals():
    toks = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    for norm in (False, True):
        hf = _qwen2_moe(norm)
        mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
        moe = mc.moe
        assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (4, 2, 24)
        assert moe.moe_layer_freq == ((0, 1, 0) if not norm else (1, 1, 0))
        assert moe.moe_router_pre_softmax is (not norm)
        assert (moe.moe_shared_expert_intermediate_size, moe.moe_shared_expert_gate) == (40, True)
        assert (mc.add_qkv_bias, mc.add_bias_linear, mc.ffn_size) == (True, False, 48)
        assert mc.rotary_base == 5000.0 and mc.untie_embeddings_and_output_weights
        # transformers' fused in-memory layout imports the model transformers computes
        with torch.no_grad():
            _close(_megazero_logits(mc, state, toks), hf(toks).logits, f"norm={norm} import")
        # the other routing computes another model: the mapping is not vacuous
        other = replace(mc, moe=replace(moe, moe_router_pre_softmax=norm))
        with torch.no_grad():
            assert (_megazero_logits(other, state, toks) - hf(toks).logits).abs().max() > 1e-3
        cfg, files = megazero_to_hf(mc, state)
        assert cfg["model_type"] == "qwen2_moe" and cfg["norm_topk_prob"] is norm
        assert (cfg["decoder_sparse_step"], cfg["mlp_only_layers"]) == (1, [0, 2] if not norm
                                                                         else [2])
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in files
        # and the per-expert file layout imports the same weights back
        _, again = hf_to_megazero(cfg, files)
        assert set(again) == set(state) and all(torch.equal(again[k], v)
                                                for k, v in state.items())
    with pytest.raises(ConversionError, match="sliding"):
        hf_to_megazero(_qwen2_moe(use_sliding_window=True, sliding_window=8,
                                  max_window_layers=3).config.to_dict(), hf.state_dict())
    for bad, why in ((dict(moe_router_score_function="sigmoid"), "softmax"),
                     (dict(moe_shared_expert_gate=False), "gate"),
                     (dict(moe_router_topk_scaling_factor=2.0), "scale")):
        with pytest.raises(ConversionError, match=why):
            megazero_to_hf(replace(mc, moe=replace(mc.moe, **bad)), state)
    # without a shared expert the model is Mixtral's, whose attention has no bias
    plain = replace(mc, moe=replace(mc.moe, moe_shared_expert_intermediate_size=None,
                                    moe_shared_expert_gate=False, moe_layer_freq=1))
    with pytest.raises(ConversionError, match="add-qkv-bias"):
        megazero_to_hf(plain, state)


def test_qwen2_dense_maps_qkv_biases_alone():
    hf = _qwen2()
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    assert (mc.add_qkv_bias, mc.add_bias_linear, mc.moe.enabled) == (True, False, False)
    assert not mc.untie_embeddings_and_output_weights
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in state
    assert "decoder.layers.1.self_attention.linear_proj.bias" not in state
    toks = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _close(_megazero_logits(mc, state, toks), hf(toks).logits, "qwen2 import")
    cfg, back = megazero_to_hf(mc, state)
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    ref = hf.state_dict()
    assert set(back) == set(ref) and all(torch.equal(back[k], v) for k, v in ref.items())
    # without --add-qkv-bias the same weights are a Llama
    llama, _ = megazero_to_hf(replace(mc, add_qkv_bias=False), state)
    assert llama["model_type"] == "llama"
    with pytest.raises(ConversionError, match="sliding"):
        hf_to_megazero(_qwen2(use_sliding_window=True, sliding_window=8,
                              max_window_layers=0).config.to_dict(), hf.state_dict())


def _imported_at_layouts(rank, world, mc, state, toks):
    """This rank's logits of the imported model at TP 2 + SP and at EP 2 (both dispatchers)."""
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel import gather_from_tensor_parallel_region
    from megazero.tensor_parallel.context import ParallelContext

    out = {}
    for name, topo, sp, dispatcher in (
            ("tp2+sp", ParallelTopology.build(tp=2, expert_groups=True), True, "allgather"),
            ("ep2 allgather", ParallelTopology.build(ep=2, expert_groups=True), False,
             "allgather"),
            ("ep2 alltoall", ParallelTopology.build(ep=2, expert_groups=True), False,
             "alltoall")):
        cfg = replace(mc, moe=replace(mc.moe, moe_token_dispatcher_type=dispatcher))
        model = GPTModel(cfg, topo, parallel=ParallelContext.from_topology(
            topo, sequence_parallel=sp)).eval()
        load_global_state(model, state, topo)
        with torch.no_grad():
            logits = model(toks)
        if topo.tp_size > 1:
            logits = gather_from_tensor_parallel_region(logits, topo.tp_group)
        out[name] = logits[..., :VOCAB]
    return out


def test_imported_qwen2_moe_computes_the_same_at_tp2_and_ep2():
    """The imported model (QKV biases, gated shared expert, dense and sparse layers) gives
    transformers' logits at TP 2 with SP and at EP 2 with either dispatcher."""
    from megazero.testing import run_distributed

    hf = _qwen2_moe(False)
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(toks).logits
    for rank, result in enumerate(run_distributed(_imported_at_layouts, 2, mc, state, toks,
                                                  timeout=240)):
        assert len(result) == 3
        for name, logits in result.items():
            _close(logits, ref, f"rank {rank} {name}")


def test_hub_style_qwen1_5_moe_config():
    """A config.json as the Hub's Qwen1.5-MoE-A2.7B ships it (transformers 4.39: top-level
    rope_theta, a window size with use_sliding_window false, no qkv_bias key)."""
    from megazero.convert.hf import hf_config_to_megazero

    c = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
         "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5632,
         "max_position_embeddings": 8192, "max_window_layers": 21, "num_attention_heads": 16,
         "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
         "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
         "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1,
         "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
         "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
         "router_aux_loss_coef": 0.001}
    m = hf_config_to_megazero(c)
    assert (m.num_layers, m.hidden_size, m.ffn_size, m.rotary_base) == (24, 2048, 5632, 1e6)
    assert (m.add_qkv_bias, m.add_bias_linear, m.untie_embeddings_and_output_weights) == (
        True, False, True)
    moe = m.moe
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (60, 4, 1408)
    assert (moe.moe_layer_freq, moe.moe_router_pre_softmax) == (1, True)
    assert (moe.moe_shared_expert_intermediate_size, moe.moe_shared_expert_gate) == (5632, True)
    with pytest.raises(ConversionError, match="sliding"):
        hf_config_to_megazero(dict(c, use_sliding_window=True))
