"""Model FLOPs per iteration and model FLOPs utilisation.

:func:`gpt_flops_per_iteration` counts every GEMM of the model as configured (grouped-query
attention's narrower K/V projections, the SwiGLU MLP's extra gate matrix, ``--ffn-hidden-size``,
the padded logit layer), as Megatron's current ``num_floating_point_operations`` does; for a
GPT-2-shaped model (one KV group per head, a 4h GELU MLP) it reduces to the closed form of the
Megatron paper, :func:`model_flops_per_iteration`: per layer and token 24h² for the
QKV/projection/MLP weights and 4sh for attention scores and values, times 3 for forward plus
backward, plus the logit layer. Both ignore recomputation (the *model* FLOPs; the *hardware*
FLOPs of full recomputation add one more forward: 96 instead of 72, not reported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megazero.config import ModelConfig

# Dense peak FLOP/s per device for 16-bit and 32-bit math, for the MFU column. Unknown
# devices (CPUs, unlisted GPUs) report no MFU rather than a made-up one.
_PEAK_FLOPS = {
    "H200": {"16": 989e12, "32": 67e12},
    "H100": {"16": 989e12, "32": 67e12},
    "A100": {"16": 312e12, "32": 19.5e12},
    "L40S": {"16": 362e12, "32": 91.6e12},
    "A10G": {"16": 125e12, "32": 31.2e12},
    "V100": {"16": 125e12, "32": 15.7e12},
}


def model_flops_per_iteration(global_batch_size: int, seq_length: int, num_layers: int,
                              hidden_size: int, vocab_size: int) -> float:
    """``72 B s l h² (1 + s/(6h) + V/(12 l h))``: forward + backward, no recomputation."""
    b, s, n_layers, h, v = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72.0 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (12 * n_layers * h))


def gpt_flops_per_iteration(model: ModelConfig, global_batch_size: int,
                            padded_vocab_size: int | None = None) -> float:
    """Forward + backward FLOPs of one iteration, GEMM by GEMM (2 FLOPs per multiply-add; the
    backward pass costs twice the forward: gradients of inputs and of weights).

    Per token and layer, forward, with ``q = a·d`` the query width (``h`` unless
    ``--kv-channels`` sets the head width ``d``): QKV ``2h(q + 2g·d)``, attention scores and
    values ``2·2·s·q`` (counted over the whole square, as Megatron does, not only the causal
    half), output projection ``2qh``, MLP ``2h·f·(2 if SwiGLU else 1) + 2f·h``; per token, the logit
    layer ``2hV``.
    """
    h, s, layers = model.hidden_size, model.seq_length, model.num_layers
    f = model.ffn_size
    vocab = padded_vocab_size or model.vocab_size
    weights, core = attention_flops_per_token(model)
    mlp = 2 * h * f * (2 if model.swiglu else 1) + 2 * f * h
    moe_layers = sum(model.moe.is_moe_layer(i, layers) for i in range(layers))
    per_token = (layers * (weights + core) + (layers - moe_layers) * mlp
                 + moe_layers * moe_mlp_flops_per_token(model) + 2 * h * vocab)
    depths = model.mtp_num_layers or 0
    if depths:  # each MTP depth: eh_proj, one layer of the last layer's kind, the logits
        last = mlp if not model.moe.is_moe_layer(layers - 1, layers) \
            else moe_mlp_flops_per_token(model)
        per_token += depths * (2 * 2 * h * h + weights + core + last + 2 * h * vocab)
    return 3.0 * global_batch_size * s * per_token


def attention_flops_per_token(model: ModelConfig) -> tuple[float, float]:
    """Forward FLOPs per token of one attention layer: ``(its weight GEMMs, the core
    attention's scores and values over the whole square)``. Standard attention with
    ``q = a·d``: QKV ``2h(q + 2g·d)`` and projection ``2qh``, core ``2·2·s·q``. Multi-latent
    attention: the down- and up-projections of queries and keys/values and the projection from
    ``a·v_head_dim``, core ``2·s·a·(qk + pe) + 2·s·a·v``."""
    h, s, a = model.hidden_size, model.seq_length, model.num_attention_heads
    if model.multi_latent_attention:
        nope, pe, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
        ql = model.q_lora_rank
        q = h * ql + ql * a * (nope + pe) if ql else h * a * (nope + pe)
        kv = h * (model.kv_lora_rank + pe) + model.kv_lora_rank * a * (nope + v)
        return float(2 * (q + kv + a * v * h)), float(2 * s * a * (nope + pe) + 2 * s * a * v)
    q = a * model.head_dim  # h, unless --kv-channels says otherwise
    kv = model.query_groups * model.head_dim
    return float(2 * h * (q + 2 * kv) + 2 * q * h), float(2 * 2 * s * q)


def moe_mlp_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE block, counting the *active* experts only (each
    token passes k of them), as Megatron's ``num_floating_point_operations`` does: the router
    ``2hE``, k experts' MLPs at ``--moe-ffn-hidden-size``, the shared expert and its gate.
    Dropped tokens are not subtracted (the model FLOPs of the configuration)."""
    moe, h = model.moe, model.hidden_size
    if moe.num_experts is None:
        return 0.0
    glu = 2 if model.swiglu else 1
    f = moe.moe_ffn_hidden_size or model.ffn_size
    flops = 2 * h * moe.num_experts + moe.moe_router_topk * (2 * h * f * glu + 2 * f * h)
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None:
        flops += 2 * h * shared * glu + 2 * shared * h
        if moe.moe_shared_expert_gate:
            flops += 2 * h
    return float(flops)


def tflops_per_device(flops_per_iteration: float, seconds_per_iteration: float,
                      world_size: int) -> float:
    """Achieved TFLOP/s per device (Megatron's ``TFLOP/s per GPU`` column)."""
    if seconds_per_iteration <= 0:
        return 0.0
    return flops_per_iteration / (seconds_per_iteration * world_size * 1e12)


def peak_flops(device_name: str, sixteen_bit: bool) -> float | None:
    """Dense peak FLOP/s of a known accelerator from its name, else ``None``."""
    name = device_name.upper()
    for key, peaks in _PEAK_FLOPS.items():
        if key in name:
            return peaks["16" if sixteen_bit else "32"]
    return None


def mfu(flops_per_iteration: float, seconds_per_iteration: float, world_size: int,
        peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or ``None`` when the device's peak is unknown."""
    if not peak or seconds_per_iteration <= 0:
        return None
    return flops_per_iteration / (seconds_per_iteration * world_size * peak)
