"""Hugging Face DeepSeek-V3 <-> megazero: tiny ``DeepseekV3ForCausalLM`` models made by
transformers (multi-latent attention with and without a query latent, YaRN, the first layer
dense, sigmoid routing with the expert bias limited to 2 of 4 expert groups, a shared expert,
routed scaling 2.5) import with tools/checkpoint/convert.py; their logits equal transformers'
at one rank, at TP 2 + SP and at EP 2 (both dispatchers); tools/generate_text.py (MLA's
latent KV cache) gives transformers' greedy ids; exporting back gives the same logits and
bitwise the same weights. Tolerance: ``|got - ref| <= 1e-5 * max|ref|`` (test_hf_convert.py's;
measured ~1e-7)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

import pytest
import torch

from megazero.convert import ConversionError, hf_to_megazero, load_global_state
from megazero.testing.hf_models import VOCAB, build_deepseek_v3

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
transformers = pytest.importorskip("transformers")


def _tool(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _close(got, ref, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err, bound = (got - ref).abs().max().item(), 1e-5 * ref.abs().max().item()
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


CASES = {
    "q-lora-yarn": lambda: build_deepseek_v3(),
    "no-q-lora-plain-rope": lambda: build_deepseek_v3(
        seed=1, q_lora_rank=None, n_group=1, topk_group=1, v_head_dim=14,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


def _megazero_logits(mc, state, toks):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    topo = ParallelTopology.single()
    model = GPTModel(mc, topo).eval()
    load_global_state(model, state, topo)
    with torch.no_grad():
        return model(toks)[..., :VOCAB]


@pytest.mark.parametrize("case", list(CASES))
def test_imports_generates_and_exports_the_same_model(case, tmp_path, capsys):
    hf = CASES[case]()
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(toks).logits
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    _close(_megazero_logits(mc, state, toks), ref, f"{case} imported logits")

    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf.save_pretrained(src)
    convert = _tool("checkpoint/convert.py", "convert")
    assert convert.main(["--loader", "hf", "--saver", "megazero", "--load-dir", str(src),
                         "--save-dir", str(ckpt)]) == 0
    capsys.readouterr()
    gen = _tool("generate_text.py", "generate_text")
    gen.main(["--load", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "10",
              "--no-stop-at-eod", "--json"])
    got = json.loads(capsys.readouterr().out)["output_ids"]
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=10)
    assert got == want[0].tolist()

    assert convert.main(["--loader", "megazero", "--saver", "hf", "--load-dir", str(ckpt),
                         "--save-dir", str(out)]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    assert back.config.n_group == hf.config.n_group
    assert back.config.rope_parameters["rope_type"] == hf.config.rope_parameters["rope_type"]
    with torch.no_grad():
        _close(back(toks).logits, ref, f"{case} exported logits")
    theirs = back.state_dict()
    assert set(theirs) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert torch.equal(theirs[k], v), k


def test_config_mapping_and_refusals():
    hf = build_deepseek_v3()
    mc, _ = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    assert mc.multi_latent_attention and mc.q_lora_rank == 20 and mc.kv_lora_rank == 12
    assert (mc.qk_head_dim, mc.qk_pos_emb_head_dim, mc.v_head_dim) == (6, 4, 10)
    assert (mc.rotary_scaling_factor, mc.original_max_position_embeddings) == (4.0, 16)
    moe = mc.moe
    assert moe.moe_layer_freq == (0, 1, 1)
    assert (moe.moe_router_num_groups, moe.moe_router_group_topk) == (4, 2)
    assert moe.moe_router_topk_scaling_factor == 2.5 and moe.moe_router_enable_expert_bias
    assert moe.moe_shared_expert_intermediate_size == 16
    c = hf.config.to_dict()
    with pytest.raises(ConversionError, match="norm_topk_prob=False"):
        hf_to_megazero({**c, "norm_topk_prob": False}, hf.state_dict())
    with pytest.raises(ConversionError, match="rope_type='longrope'"):
        hf_to_megazero({**c, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}},
                       hf.state_dict())


def _imported_at_layouts(rank, world, mc, state, toks):
    """This rank's logits of the imported model at TP 2 + SP and at EP 2."""
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


def test_imported_deepseek_v3_computes_the_same_at_tp2_sp_and_ep2():
    from megazero.testing import run_distributed

    hf = build_deepseek_v3()
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(toks).logits
    for rank, result in enumerate(run_distributed(_imported_at_layouts, 2, mc, state, toks,
                                                  timeout=240)):
        assert len(result) == 3
        for name, logits in result.items():
            _close(logits, ref, f"rank {rank} {name}")


def _with_mtp(hf, seed: int = 5) -> dict[str, torch.Tensor]:
    """``hf``'s state plus one MTP module under DeepSeek's naming (layer L = 3): random
    weights, its transformer layer of the last layer's kind, copies of the embedding and
    head."""
    g = torch.Generator().manual_seed(seed)
    state = dict(hf.state_dict())
    layers, h = hf.config.num_hidden_layers, hf.config.hidden_size
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for name, value in list(state.items()):
        if name.startswith(last):
            noise = torch.randn(value.shape, generator=g) * value.float().std().clamp(min=0.05)
            state[mtp + name[len(last):]] = (value + noise).to(value.dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{mtp}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    state[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    state[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return state


def _mtp_reference(hf, state, toks, labels) -> torch.Tensor:
    """Depth 1's per-token loss ``[b, s - 1]`` from transformers' own modules: the MoE decoder
    layer, RMSNorms and rotary embedding, loaded with the MTP weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    cfg, n = hf.config, hf.config.num_hidden_layers
    layer = DeepseekV3DecoderLayer(cfg, n - 1).eval()
    prefix = f"model.layers.{n}."
    layer.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                           if k.startswith(prefix) and k[len(prefix):] in layer.state_dict()})
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(state[f"{prefix}{name}.weight"])
    with torch.no_grad():
        hidden = hf.model(toks).last_hidden_state  # after the final norm
        x = torch.cat([norms["enorm"](hf.model.embed_tokens(labels)), norms["hnorm"](hidden)],
                      dim=-1) @ state[prefix + "eh_proj.weight"].t()
        pos = torch.arange(toks.shape[1])[None]
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos)
        logits = hf.lm_head(norms["shared_head.norm"](x))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), reduction="none")
    return loss.view(toks.shape[0], -1)


def test_mtp_weights_under_deepseek_naming_import_compute_and_export():
    from megazero.convert import megazero_to_hf
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    hf = build_deepseek_v3()
    state = _with_mtp(hf)
    config = dict(hf.config.to_dict(), num_nextn_predict_layers=1)
    mc, ours = hf_to_megazero(config, state)
    assert mc.mtp_num_layers == 1
    model = GPTModel(mc, ParallelTopology.single()).eval()
    load_global_state(model, ours, ParallelTopology.single())
    seq = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    toks, labels = seq[:, :-1], seq[:, 1:]
    with torch.no_grad():
        model(toks, labels)
    got = model.mtp.pending[0][:, :-1]  # the last position has no target at depth 1
    want = _mtp_reference(hf, state, toks, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    back_config, back = megazero_to_hf(mc, ours)
    assert back_config["num_nextn_predict_layers"] == 1
    for k, v in state.items():  # the per-expert layout where transformers holds them fused
        if ".experts." not in k:
            assert torch.equal(back[k], v.float()), k
    again_config, again = hf_to_megazero(back_config, back)
    assert again_config == mc and set(again) == set(ours)
    for k, v in ours.items():
        assert torch.equal(again[k], v), k
    # transformers' own state (no MTP weights) imports without MTP
    assert hf_to_megazero(config, hf.state_dict())[0].mtp_num_layers is None
