"""Hugging Face Mixtral (``MixtralForCausalLM``) <-> megazero's Llama block with MoE layers.

Mixtral is Llama with every MLP replaced by a router (``gate``, no bias) and
``num_local_experts`` SwiGLU experts, ``num_experts_per_tok`` of which each token uses:
softmax over all experts, top k, weights renormalised to sum 1 -- exactly megazero's default
softmax router (top-k logits, softmax over those k). Experts map one to one by their global
index: megazero's ``experts.local_experts.<e>.linear_fc1`` is ``[gate; up]`` (w1; w3) and
``linear_fc2`` is ``down`` (w2).

Weights are read in either layout transformers writes: per expert
(``block_sparse_moe.experts.<e>.w1/w2/w3``, the Hub's files) or fused
(``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` and ``down_proj`` ``[E, H, F]``, transformers 5);
they are written per expert, the layout every transformers version loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig


def is_mixtral(m: ModelConfig) -> bool:
    return m.moe.enabled


def config_to_megazero(c: Mapping[str, Any], llama: ModelConfig,
                       refuse: Callable[[str, str], None]) -> ModelConfig:
    """``llama``: the dense part, read from ``c`` as for Llama."""
    if c.get("router_jitter_noise"):
        refuse(f"router_jitter_noise={c['router_jitter_noise']}", "megazero's router adds no "
               "noise; set it to 0")
    if c.get("sliding_window"):
        refuse(f"sliding_window={c['sliding_window']}", "megazero attends to the whole sequence")
    moe = MoEConfig(num_experts=int(c["num_local_experts"]),
                    moe_router_topk=int(c["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(c["intermediate_size"]),
                    moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)))
    return replace(llama, moe=moe)


def config_from_megazero(m: ModelConfig, llama: dict[str, Any],
                         refuse: Callable[[str, str], None]) -> dict[str, Any]:
    """``llama``: the HF Llama config of the dense part."""
    moe = m.moe
    assert moe.num_experts is not None
    problems = [(f"--moe-layer-freq {moe.moe_layer_freq}", "Mixtral has experts in every layer")
                if moe.moe_layer_freq not in (1, (1,) * m.num_layers) else None,
                ("--moe-router-score-function sigmoid", "Mixtral routes by softmax")
                if moe.moe_router_score_function != "softmax" else None,
                ("--moe-router-pre-softmax", "Mixtral renormalises the top-k weights")
                if moe.moe_router_pre_softmax and moe.moe_router_topk > 1 else None,
                ("--moe-router-topk-scaling-factor", "Mixtral does not scale its weights")
                if moe.moe_router_topk_scaling_factor not in (None, 1.0) else None,
                ("--moe-shared-expert-intermediate-size", "Mixtral has no shared expert")
                if moe.moe_shared_expert_intermediate_size is not None else None,
                ("--moe-router-enable-expert-bias", "Mixtral has no expert bias")
                if moe.moe_router_enable_expert_bias else None,
                ("--add-bias-linear", "Mixtral's linears have no bias")
                if m.add_bias_linear else None,
                ("--add-qkv-bias", "Mixtral's attention has no bias")
                if m.add_qkv_bias else None]
    for p in problems:
        if p is not None:
            refuse(*p)
    out = dict(llama, model_type="mixtral", architectures=["MixtralForCausalLM"],
               intermediate_size=moe.moe_ffn_hidden_size or m.ffn_size,
               num_local_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
               router_aux_loss_coef=moe.moe_aux_loss_coeff, router_jitter_noise=0.0,
               output_router_logits=False, sliding_window=None)
    for key in ("mlp_bias", "attention_bias"):
        out.pop(key, None)
    return out


def expert_name(i: int, e: int, rest: str) -> str:
    """megazero's global name of expert ``e`` of layer ``i`` (``rest``: ``linear_fc1.weight``)."""
    return f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest}"


def experts_from_split(i: int, e_count: int, src: Callable[[str], torch.Tensor], prefix: str,
                       gate: str, up: str, down: str) -> dict[str, torch.Tensor]:
    """Layer ``i``'s experts from the per-expert layout ``{prefix}{e}.{gate|up|down}``
    (Mixtral's ``w1``/``w3``/``w2``, Qwen2-MoE's ``gate_proj``/``up_proj``/``down_proj``)."""
    out: dict[str, torch.Tensor] = {}
    for e in range(e_count):
        p = f"{prefix}{e}."
        out[expert_name(i, e, "linear_fc1.weight")] = torch.cat([src(p + gate), src(p + up)],
                                                                dim=0)
        out[expert_name(i, e, "linear_fc2.weight")] = src(p + down)
    return out


def experts_from_fused(i: int, e_count: int, gate_up: torch.Tensor, down: torch.Tensor
                       ) -> dict[str, torch.Tensor]:
    """Layer ``i``'s experts from transformers 5's fused ``gate_up_proj`` ``[E, 2F, H]`` (rows
    ``[gate; up]``, megazero's ``linear_fc1``) and ``down_proj`` ``[E, H, F]``."""
    out: dict[str, torch.Tensor] = {}
    for e in range(e_count):
        out[expert_name(i, e, "linear_fc1.weight")] = gate_up[e].contiguous()
        out[expert_name(i, e, "linear_fc2.weight")] = down[e].contiguous()
    return out


def experts_to_split(i: int, e_count: int, get: Callable[[str], torch.Tensor], prefix: str,
                     gate: str, up: str, down: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`experts_from_split`: the layout every transformers version loads."""
    out: dict[str, torch.Tensor] = {}
    for e in range(e_count):
        p = f"{prefix}{e}."
        g, u = get(expert_name(i, e, "linear_fc1.weight")).chunk(2, dim=0)
        out[p + gate], out[p + up] = g.contiguous(), u.contiguous()
        out[p + down] = get(expert_name(i, e, "linear_fc2.weight"))
    return out


_W = ("w1.weight", "w3.weight", "w2.weight")  # Mixtral's gate, up, down


#: the per-expert projections of the Qwen MoE families (the Llama MLP's names)
QWEN_SPLIT = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def qwen_router_and_experts(m: ModelConfig, i: int, src: Callable[[str], torch.Tensor],
                            names: set[str]) -> dict[str, torch.Tensor]:
    """A Qwen MoE sparse layer ``i``'s router (``mlp.gate``) and experts, stored fused
    (``experts.gate_up_proj``/``down_proj``, newer transformers) or one module per expert."""
    e_count = m.moe.num_experts
    assert e_count is not None
    p = f"model.layers.{i}.mlp."
    if f"{p}experts.gate_up_proj" in names:
        experts = experts_from_fused(i, e_count, src(p + "experts.gate_up_proj"),
                                     src(p + "experts.down_proj"))
    else:
        experts = experts_from_split(i, e_count, src, f"{p}experts.", *QWEN_SPLIT)
    return {f"decoder.layers.{i}.mlp.router.weight": src(p + "gate.weight"), **experts}


def mlp_to_megazero(m: ModelConfig, i: int, src: Callable[[str], torch.Tensor],
                    names: set[str]) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts from whichever layout the HF state uses."""
    e_count = m.moe.num_experts
    assert e_count is not None
    legacy = f"model.layers.{i}.block_sparse_moe."
    if f"{legacy}gate.weight" in names:
        return {f"decoder.layers.{i}.mlp.router.weight": src(f"{legacy}gate.weight"),
                **experts_from_split(i, e_count, src, f"{legacy}experts.", *_W)}
    p = f"model.layers.{i}.mlp."
    return {f"decoder.layers.{i}.mlp.router.weight": src(p + "gate.weight"),
            **experts_from_fused(i, e_count, src(p + "experts.gate_up_proj"),
                                 src(p + "experts.down_proj"))}


def mlp_from_megazero(m: ModelConfig, i: int, get: Callable[[str], torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts in the per-expert layout."""
    e_count = m.moe.num_experts
    assert e_count is not None
    p = f"model.layers.{i}.block_sparse_moe."
    return {f"{p}gate.weight": get(f"decoder.layers.{i}.mlp.router.weight"),
            **experts_to_split(i, e_count, get, f"{p}experts.", *_W)}
