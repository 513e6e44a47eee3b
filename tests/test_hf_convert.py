"""Hugging Face <-> megazero conversion: the converted model computes the same logits.

References are transformers' own GPT2LMHeadModel / LlamaForCausalLM, built tiny and random in
code. Tolerance: fp32 logits with the same math done in a different order (fused vs split
projections, F.rms_norm vs HF's explicit RMSNorm, rope tables in float64 vs float32) agree to
a few ulps: ``|got - ref| <= 1e-5 * max|ref|`` (measured ~3e-7 relative). A wrong QKV order, a
swapped norm, exact vs tanh GELU or a wrong rope base gives errors of 1e-3 and more.
"""

import pytest
import torch

from megazero.convert import (
    ConversionError,
    hf_to_megazero,
    load_global_state,
    megazero_to_hf,
    model_global_state,
)
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import gather_from_tensor_parallel_region
from megazero.testing import run_distributed
from megazero.testing.hf_models import VOCAB, build

# GPT-2 with weights large enough that GELU's inputs span O(1), where tanh and exact differ.
KINDS = {"gpt2": dict(initializer_range=0.3), "llama": dict(initializer_range=0.1)}


def tokens(seed=1, batch=2, seq=16):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_close(got, ref, what, rel=1e-5):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err, bound = (got - ref).abs().max().item(), rel * ref.abs().max().item()
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


def megazero_logits(model_config, state, toks):
    topo = ParallelTopology.single()
    model = GPTModel(model_config, topo).eval()
    load_global_state(model, state, topo)
    with torch.no_grad():
        return model(toks)[..., :model_config.vocab_size]


@pytest.fixture(scope="module", params=list(KINDS))
def hf_model(request):
    return request.param, build(request.param, **KINDS[request.param])


def test_import_logits_match_transformers(hf_model):
    kind, hf = hf_model
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    assert mc.model_preset == kind
    if kind == "llama":  # the non-default settings really arrive
        assert (mc.query_groups, mc.rotary_base, mc.norm_epsilon) == (4, 5000.0, 1e-6)
        assert mc.untie_embeddings_and_output_weights
    else:
        assert mc.openai_gelu and not mc.untie_embeddings_and_output_weights
    toks = tokens()
    with torch.no_grad():
        ref = hf(toks).logits
    assert_close(megazero_logits(mc, state, toks), ref, f"{kind} imported logits")


def test_round_trip_is_bitwise(hf_model):
    kind, hf = hf_model
    ref = hf.state_dict()
    mc, state = hf_to_megazero(hf.config.to_dict(), ref)
    cfg, back = megazero_to_hf(mc, state)
    assert set(back) == set(ref)
    for k, v in ref.items():
        assert torch.equal(back[k], v), k
    assert cfg["model_type"] == kind


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_logits_match_megazero(kind):
    import transformers

    from megazero.config import ModelConfig

    base = dict(num_layers=2, seq_length=32, vocab_size=VOCAB, attention_dropout=0.0,
                hidden_dropout=0.0, init_method_std=0.2)
    if kind == "llama":
        mc = ModelConfig.preset("llama", hidden_size=64, num_attention_heads=8,
                                num_query_groups=2, ffn_hidden_size=96, rotary_base=500.0,
                                norm_epsilon=1e-6, **base)
    else:
        mc = ModelConfig.preset("gpt2", hidden_size=32, num_attention_heads=4, openai_gelu=True,
                                **base)
    topo = ParallelTopology.single()
    model = GPTModel(mc, topo, seed=7).eval()
    with torch.no_grad():  # norms away from 1/0 so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    state = model_global_state(model, topo)
    cfg, hf_state = megazero_to_hf(mc, state)
    config_cls = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}[kind]
    model_cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}
    hf = model_cls[kind](config_cls(**cfg)).eval()
    hf.load_state_dict(hf_state, strict=True)
    toks = tokens(seed=3)
    with torch.no_grad():
        ref = model(toks)[..., :VOCAB]
        got = hf(toks).logits
    assert_close(got, ref, f"{kind} exported logits")


def _pipeline_logits(rank, world, model_config, state, toks):
    """tp=2 x pp=2: stage 0 embeds and runs layer 0, sends the hidden states to stage 1, which
    returns the full-vocabulary logits gathered over its TP group."""
    import torch.distributed as dist

    from megazero.pipeline.partition import build_model_chunks

    topo = ParallelTopology.build(tp=2, pp=2)
    (chunk,) = build_model_chunks(model_config, topo)
    chunk.eval()
    load_global_state(chunk, state, topo)
    peers = topo.ranks("pp")
    s, b, h = toks.shape[1], toks.shape[0], model_config.hidden_size
    with torch.no_grad():
        if topo.pp_rank == 0:
            dist.send(chunk(toks).contiguous(), peers[1])
            return None
        hidden = torch.empty(s, b, h)
        dist.recv(hidden, peers[0])
        local = chunk(None, hidden_states=hidden)
        # numpy: a torch tensor would travel back through shared memory of an exited process
        return gather_from_tensor_parallel_region(local, topo.tp_group)[..., :VOCAB].numpy()


def test_import_logits_match_at_tp2_pp2():
    """Both presets, one 4-rank world each call; the global state is made in this process."""
    cases = []
    for kind, kw in KINDS.items():
        hf = build(kind, seed=5, **kw)
        mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
        toks = tokens(seed=9)
        with torch.no_grad():
            cases.append((kind, mc, state, toks, hf(toks).logits))
    for kind, mc, state, toks, ref in cases:
        out = run_distributed(_pipeline_logits, 4, mc, state, toks)
        for r in (2, 3):  # last stage, both TP ranks
            assert_close(torch.from_numpy(out[r]), ref, f"{kind} tp2 pp2 rank {r}")


@pytest.mark.parametrize("kind,override,needle", [
    ("llama", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope scaling"),
    ("llama", dict(sliding_window=8), "sliding_window"),
    ("llama", dict(num_local_experts=4), "num_local_experts"),
    ("llama", dict(model_type="mistral"), "model_type='mistral'"),
    ("gpt2", dict(activation_function="relu"), "activation_function"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_configs_are_refused_by_name(kind, override, needle):
    from megazero.testing.hf_models import gpt2_config, llama_config

    cfg = (gpt2_config() if kind == "gpt2" else llama_config()).to_dict()
    cfg.update(override)
    with pytest.raises(ConversionError, match=needle.replace("(", r"\(")):
        hf_to_megazero(cfg, {})


def test_extra_bias_tensor_is_refused():
    hf = build("llama")
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ConversionError, match="q_proj.bias"):
        hf_to_megazero(hf.config.to_dict(), state)


def test_megazero_model_without_hf_twin_is_refused():
    from megazero.config import ModelConfig

    mc = ModelConfig.preset("llama", normalization="LayerNorm")
    with pytest.raises(ConversionError, match="normalization='LayerNorm'"):
        megazero_to_hf(mc, {})


def test_llama_with_biases_on_every_linear():
    """attention_bias and mlp_bias together are megazero's --add-bias-linear with the llama
    block: imported logits match, the round trip is bitwise and the export names both."""
    hf = build("llama", attention_bias=True, mlp_bias=True, initializer_range=0.1)
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    assert mc.add_bias_linear and mc.swiglu
    toks = tokens()
    with torch.no_grad():
        ref = hf(toks).logits
    assert_close(megazero_logits(mc, state, toks), ref, "llama with biases")
    cfg, back = megazero_to_hf(mc, state)
    assert cfg["attention_bias"] and cfg["mlp_bias"]
    assert set(back) == set(hf.state_dict())
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
