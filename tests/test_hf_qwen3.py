"""Hugging Face Qwen3 and Qwen3-MoE <-> megazero: tiny ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM`` models made by transformers, imported with tools/checkpoint/convert.py,
generate transformers' greedy tokens with tools/generate_text.py; exporting them back gives the
same logits and the same weights.

The models have query/key RMSNorms (``--qk-layernorm``) and a ``head_dim`` (12) that is not
hidden / heads (32 / 4 = 8): ``--kv-channels``. The MoE models mix dense and sparse layers
(``decoder_sparse_step`` 2, ``mlp_only_layers``) and route both ways: ``norm_topk_prob`` False
(``--moe-router-pre-softmax``) and True. transformers initialises norms to one, so they are
perturbed to make them matter. Tolerance: ``|got - ref| <= 1e-5 * max|ref|``.
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
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
            initializer_range=0.2, rope_theta=5000.0)


def _tool(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _qwen3_moe(norm_topk_prob: bool = False, **kw):
    """3 layers; sparse layers {1} (norm False) or {0, 1} (norm True)."""
    cfg = transformers.Qwen3MoeConfig(**{**BASE, **dict(
        moe_intermediate_size=24, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, **SPARSE[norm_topk_prob]), **kw})
    torch.manual_seed(0)
    return _perturbed(transformers.Qwen3MoeForCausalLM(cfg))


def _qwen3(**kw):
    cfg = transformers.Qwen3Config(**{**BASE, **dict(num_hidden_layers=2,
                                                     tie_word_embeddings=True), **kw})
    torch.manual_seed(0)
    return _perturbed(transformers.Qwen3ForCausalLM(cfg))


def _close(got, ref, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err, bound = (got - ref).abs().max().item(), 1e-5 * ref.abs().max().item()
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


CASES = {"moe-pre-softmax": lambda: _qwen3_moe(False), "moe-renormalised": lambda: _qwen3_moe(True),
         "dense-tied": _qwen3}


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
    assert type(back) is type(hf) and back.config.head_dim == 12
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


def test_qwen3_configs_map_and_refuse():
    toks = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    for norm in (False, True):
        hf = _qwen3_moe(norm)
        mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
        moe = mc.moe
        assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (4, 2, 24)
        assert moe.moe_layer_freq == ((0, 1, 0) if not norm else (1, 1, 0))
        assert moe.moe_router_pre_softmax is (not norm)
        assert moe.moe_shared_expert_intermediate_size is None
        assert (mc.qk_layernorm, mc.kv_channels, mc.head_dim, mc.ffn_size) == (True, 12, 12, 48)
        assert (mc.add_qkv_bias, mc.add_bias_linear) == (False, False)
        assert mc.untie_embeddings_and_output_weights
        assert state["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (12,)
        with torch.no_grad():
            _close(_megazero_logits(mc, state, toks), hf(toks).logits, f"norm={norm} import")
        # the mapping is not vacuous: the other routing, or no q/k norms, is another model
        for other in (replace(mc, moe=replace(moe, moe_router_pre_softmax=norm)),):
            with torch.no_grad():
                assert (_megazero_logits(other, state, toks) - hf(toks).logits).abs().max() > 1e-3
        plain = {k: v for k, v in state.items() if "_layernorm.weight" not in k
                 or "self_attention" not in k}
        with torch.no_grad():
            assert (_megazero_logits(replace(mc, qk_layernorm=False), plain, toks)
                    - hf(toks).logits).abs().max() > 1e-3
        cfg, files = megazero_to_hf(mc, state)
        assert cfg["model_type"] == "qwen3_moe" and cfg["norm_topk_prob"] is norm
        assert (cfg["decoder_sparse_step"], cfg["mlp_only_layers"]) == (1, [0, 2] if not norm
                                                                         else [2])
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in files
        assert "model.layers.2.self_attn.k_norm.weight" in files
        _, again = hf_to_megazero(cfg, files)  # the per-expert file layout imports back
        assert set(again) == set(state) and all(torch.equal(again[k], v)
                                                for k, v in state.items())
    with pytest.raises(ConversionError, match="sliding"):
        hf_to_megazero(_qwen3_moe(use_sliding_window=True, sliding_window=8,
                                  max_window_layers=0).config.to_dict(), hf.state_dict())
    for bad, why in ((dict(moe_router_score_function="sigmoid"), "softmax"),
                     (dict(moe_shared_expert_intermediate_size=16), "shared expert"),
                     (dict(moe_expert_capacity_factor=1.0), "dropless"),
                     (dict(moe_router_topk_scaling_factor=2.0), "scale")):
        with pytest.raises(ConversionError, match=why):
            megazero_to_hf(replace(mc, moe=replace(mc.moe, **bad)), state)
    with pytest.raises(ConversionError, match="add-qkv-bias"):
        megazero_to_hf(replace(mc, add_qkv_bias=True), state)
    gpt = replace(mc, moe=replace(mc.moe, num_experts=None), position_embedding_type=
                  "learned_absolute", normalization="LayerNorm", swiglu=False,
                  add_bias_linear=True, num_query_groups=None,
                  group_query_attention=False)
    with pytest.raises(ConversionError, match="qk-layernorm"):
        megazero_to_hf(gpt, state)


def test_qwen3_dense_tied_and_head_dim():
    hf = _qwen3()
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    assert (mc.qk_layernorm, mc.head_dim, mc.moe.enabled) == (True, 12, False)
    assert not mc.untie_embeddings_and_output_weights and "output_layer.weight" not in state
    assert state["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 4) * 12, 32)
    assert state["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 48)
    toks = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _close(_megazero_logits(mc, state, toks), hf(toks).logits, "qwen3 import")
    cfg, back = megazero_to_hf(mc, state)
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    ref = hf.state_dict()
    assert set(back) == set(ref) and all(torch.equal(back[k], v) for k, v in ref.items())
    # without the q/k norms (and their weights) the same weights are a Llama with head_dim 12
    plain = {k: v for k, v in state.items() if "self_attention." not in k or "norm" not in k}
    llama, _ = megazero_to_hf(replace(mc, qk_layernorm=False), plain)
    assert llama["model_type"] == "llama" and llama["head_dim"] == 12


def _imported_at_layouts(rank, world, mc, state, toks):
    """This rank's logits of the imported model at TP 2 + SP and at EP 2 (alltoall)."""
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel import gather_from_tensor_parallel_region
    from megazero.tensor_parallel.context import ParallelContext

    out = {}
    for name, topo, sp, dispatcher in (
            ("tp2", ParallelTopology.build(tp=2, expert_groups=True), False, "allgather"),
            ("tp2+sp", ParallelTopology.build(tp=2, expert_groups=True), True, "allgather"),
            ("ep2 alltoall", ParallelTopology.build(ep=2, expert_groups=True), False,
             "alltoall")):
        if not sp and topo.tp_size > 1 and mc.moe.enabled:
            continue  # MoE with TP needs SP
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


def test_imported_qwen3_moe_computes_the_same_at_tp2_and_ep2():
    """The imported model (q/k norms, head_dim 12, dense and sparse layers) gives
    transformers' logits at TP 2 with SP (each rank normalising its own heads) and at EP 2."""
    from megazero.testing import run_distributed

    hf = _qwen3_moe(False)
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(toks).logits
    for rank, result in enumerate(run_distributed(_imported_at_layouts, 2, mc, state, toks,
                                                  timeout=240)):
        assert sorted(result) == ["ep2 alltoall", "tp2+sp"]
        for name, logits in result.items():
            _close(logits, ref, f"rank {rank} {name}")
