"""A model's parameter counts from its config alone, without building it: the whole model, the
parameters one token uses (each MoE layer's top-k experts of E), and the multi-token-prediction
modules' share. Building a 671B-parameter model, even on the meta device, takes minutes; the
arithmetic takes microseconds, and a test holds it equal to the count of the model megazero
builds (one rank, the vocabulary padded as at TP 1).

The MTP modules reuse the main model's embedding and output head, so their share is their own
norms, projection and transformer layer (DeepSeek-V3: 11.6B, its "14B" adding the copies of the
embedding and head its checkpoints store).
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config import ModelConfig
from megazero.tensor_parallel.layers import pad_vocab_size


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter, MTP modules included
    active: int  # used by one token: each MoE layer's top-k experts, not all E
    mtp: int  # the multi-token-prediction modules' own
    mtp_active: int

    @property
    def main(self) -> int:
        """The model without its MTP modules (DeepSeek-V3's "671B")."""
        return self.total - self.mtp

    @property
    def main_active(self) -> int:
        return self.active - self.mtp_active


def _norm(m: ModelConfig, width: int) -> int:
    return width * (2 if m.normalization == "LayerNorm" else 1)


def _linear(m: ModelConfig, n_in: int, n_out: int, bias: bool | None = None) -> int:
    return n_in * n_out + (n_out if (m.add_bias_linear if bias is None else bias) else 0)


def attention_params(m: ModelConfig) -> int:
    h, heads = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        nope, pe, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        q_out = heads * (nope + pe)
        if m.q_lora_rank is None:
            q = h * q_out
        else:
            q = _linear(m, h, m.q_lora_rank) + m.q_lora_rank + m.q_lora_rank * q_out
        kv = (_linear(m, h, m.kv_lora_rank + pe) + m.kv_lora_rank
              + m.kv_lora_rank * heads * (nope + v))
        return q + kv + _linear(m, heads * v, h)
    d, groups = m.head_dim, m.query_groups
    qkv = _linear(m, h, (heads + 2 * groups) * d, m.qkv_bias)
    norms = 2 * _norm(m, d) if m.qk_layernorm else 0
    return qkv + norms + _linear(m, heads * d, h)


def _mlp(m: ModelConfig, ffn: int) -> int:
    h = m.hidden_size
    return _linear(m, h, ffn * (2 if m.swiglu else 1)) + _linear(m, ffn, h)


def layer_params(m: ModelConfig, layer: int) -> tuple[int, int]:
    """``(parameters, of which routed experts)`` of global layer ``layer`` (an MTP layer, past
    the last, is of the last layer's kind)."""
    base = 2 * _norm(m, m.hidden_size) + attention_params(m)
    moe = m.moe
    if not moe.is_moe_layer(min(layer, m.num_layers - 1), m.num_layers):
        return base + _mlp(m, m.ffn_size), 0
    assert moe.num_experts is not None
    h = m.hidden_size
    experts = moe.num_experts * _mlp(m, moe.moe_ffn_hidden_size or m.ffn_size)
    router = moe.num_experts * h + (moe.num_experts if moe.moe_router_enable_expert_bias else 0)
    shared = 0
    if moe.moe_shared_expert_intermediate_size:
        shared = _mlp(m, moe.moe_shared_expert_intermediate_size) + (
            h if moe.moe_shared_expert_gate else 0)
    return base + router + shared + experts, experts


def parameter_counts(m: ModelConfig) -> ParameterCounts:
    h = m.hidden_size
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    ends = vocab * h + _norm(m, h)
    if m.position_embedding_type == "learned_absolute":
        ends += m.max_positions * h
    if m.untie_embeddings_and_output_weights:
        ends += vocab * h
    k, e = m.moe.moe_router_topk, m.moe.num_experts or 1
    total = active = ends
    for i in range(m.num_layers):
        n, experts = layer_params(m, i)
        total += n
        active += n - experts + experts * k // e
    mtp = mtp_active = 0
    for depth in range(m.mtp_num_layers or 0):
        n, experts = layer_params(m, m.num_layers + depth)
        own = 3 * _norm(m, h) + 2 * h * h + n
        mtp += own
        mtp_active += own - experts + experts * k // e
    return ParameterCounts(total + mtp, active + mtp_active, mtp, mtp_active)


def describe(m: ModelConfig) -> str:
    """One line: the counts a report prints."""
    c = parameter_counts(m)
    line = f"{c.main:,} parameters ({c.main / 1e9:.1f}B)"
    if m.moe.enabled:
        line += f", {c.main_active:,} active per token ({c.main_active / 1e9:.1f}B)"
    if c.mtp:
        line += (f"; multi-token prediction {c.mtp:,} more ({c.mtp / 1e9:.2f}B, "
                 f"{c.mtp_active:,} active)")
    return line
