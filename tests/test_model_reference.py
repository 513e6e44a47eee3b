"""The tp=1 model against an independent plain-PyTorch GPT written from the definitions, using
the same (full) weights: checks the conventions the parallel tests cannot see (fused QKV layout
by query group, SwiGLU ``[gate; up]``, RoPE, tied head, unpadded loss)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.model.positional import RotaryEmbedding, apply_rotary
from megazero.tensor_parallel import ParallelContext, full_model_state_dict
from megazero.testing.tiny_gpt import assert_close, batch, tiny_config


def _norm(x, sd, prefix, cfg):
    w = sd[prefix + ".weight"]
    if cfg.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) * w
    return F.layer_norm(x, (x.shape[-1],), w, sd[prefix + ".bias"], cfg.norm_epsilon)


def _linear(x, sd, prefix):
    return F.linear(x, sd[prefix + ".weight"], sd.get(prefix + ".bias"))


def _rope(x, base):  # x [b, s, heads, d]; rotate pairs (i, i + d/2) by pos * base^(-2i/d)
    b, s, n, d = x.shape
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv  # [s, d/2]
    cos, sin = ang.cos().float()[None, :, None], ang.sin().float()[None, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def plain_gpt_loss(sd, cfg, tokens, labels):
    b, s = tokens.shape
    heads, groups, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    per = heads // groups
    x = sd["embedding.word_embeddings.weight"][tokens]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + sd["embedding.position_embeddings.weight"][:s]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        qkv = _linear(_norm(x, sd, p + "input_layernorm", cfg), sd,
                      p + "self_attention.linear_qkv").view(b, s, groups, per + 2, d)
        q = qkv[:, :, :, :per].reshape(b, s, heads, d)
        k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
        if cfg.position_embedding_type == "rope":
            q, k = _rope(q, cfg.rotary_base), _rope(k, cfg.rotary_base)
        k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(d)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        ctx = torch.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, heads * d)
        x = x + _linear(ctx, sd, p + "self_attention.linear_proj")
        h = _linear(_norm(x, sd, p + "pre_mlp_layernorm", cfg), sd, p + "mlp.linear_fc1")
        if cfg.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        x = x + _linear(h, sd, p + "mlp.linear_fc2")
    x = _norm(x, sd, "decoder.final_layernorm", cfg)
    head = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    logits = x @ head.t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="none").view(b, s)


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_model_matches_plain_reference(preset, backend):
    cfg = tiny_config(preset)
    topo = ParallelTopology.single()
    model = GPTModel(cfg, topo, parallel=ParallelContext(attention_backend=backend), seed=99)
    sd = full_model_state_dict(model, topo)
    tokens, labels = batch(5)
    loss = model(tokens, labels)
    ref = plain_gpt_loss(sd, cfg, tokens, labels)
    assert loss.shape == ref.shape == (2, 16)
    assert_close(loss.detach(), ref, f"{preset} {backend}")
    assert abs(ref.mean().item() - math.log(cfg.vocab_size)) < 0.5  # sane init scale
    # parameter names and seeding: a different seed gives different weights
    other = full_model_state_dict(GPTModel(cfg, topo, seed=100), topo)
    assert not torch.equal(other["decoder.layers.1.mlp.linear_fc1.weight"],
                           sd["decoder.layers.1.mlp.linear_fc1.weight"])


def test_rotary_matches_definition_and_is_relative():
    rot = RotaryEmbedding(8, 32, base=500.0)
    x = torch.randn(32, 1, 2, 8)
    cos, sin = rot(32, torch.float32)
    got = apply_rotary(x, cos, sin)
    torch.testing.assert_close(got, _rope(x.transpose(0, 1), 500.0).transpose(0, 1))
    q, k = torch.randn(8), torch.randn(8)
    qs, ks = q.expand(32, 1, 1, 8), k.expand(32, 1, 1, 8)
    rq, rk = apply_rotary(qs, cos, sin)[:, 0, 0], apply_rotary(ks, cos, sin)[:, 0, 0]
    # <R_m q, R_n k> depends on m - n only
    torch.testing.assert_close(rq[5] @ rk[2], rq[20] @ rk[17], rtol=1e-5, atol=1e-5)


def test_attention_backend_selection():
    cfg = tiny_config("gpt2")
    topo = ParallelTopology.single()
    with pytest.raises(ConfigError, match="attention_backend 'fast'"):
        GPTModel(cfg, topo, parallel=ParallelContext(attention_backend="fast"))
    model = GPTModel(cfg, topo, parallel=ParallelContext(attention_backend="flash"))
    tokens, labels = batch(6)
    with pytest.raises(RuntimeError, match="flash-attn installed and CUDA fp16/bf16"):
        model(tokens, labels)
    auto = GPTModel(cfg, topo)  # CPU fp32: falls back to SDPA
    core = auto.decoder.layers["0"].self_attention.core_attention
    assert core._resolve(torch.zeros(1)) == "sdpa"


def test_autocast_bf16_forward_backward():
    cfg = tiny_config("llama")
    topo = ParallelTopology.single()
    model = GPTModel(cfg, topo)
    tokens, labels = batch(7)
    ref = model(tokens, labels).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels)
    loss.mean().backward()
    assert loss.dtype == torch.float32
    # bf16 has 8 mantissa bits: per-token losses agree to a few 1e-2
    assert (loss.detach() - ref).abs().max() < 5e-2
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
