"""Hugging Face Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) <->
megazero's Llama block with ``--qk-layernorm``.

Qwen3 is Llama (no biases) plus an RMSNorm over each head's queries and keys before RoPE
(``self_attn.q_norm`` / ``k_norm``, one ``head_dim`` weight each): megazero's
``--qk-layernorm`` with ``--normalization RMSNorm`` (``self_attention.q_layernorm`` /
``k_layernorm``). Its ``head_dim`` need not be ``hidden_size / num_attention_heads``
(Qwen3-0.6B: 1024 / 16 heads of 128), which is ``--kv-channels``. Embeddings are untied unless
the config ties them (the small models do).

Qwen3-MoE replaces the MLP of some layers by a router and experts, with no shared expert:

* which layers: ``decoder_sparse_step`` and ``mlp_only_layers`` as Qwen2-MoE
  (:func:`megazero.convert.hf_qwen2.sparse_layers`; exported as step 1 with the dense layers
  listed);
* router ``mlp.gate`` (no bias): softmax over all experts, top ``num_experts_per_tok``;
  ``norm_topk_prob`` True renormalises those to sum 1 (megazero's default), False keeps the
  full-softmax probabilities (``--moe-router-pre-softmax``);
* experts ``moe_intermediate_size`` wide, per expert ``mlp.experts.<e>.{gate,up,down}_proj``
  (the Hub's files) or fused ``gate_up_proj`` / ``down_proj`` (transformers 5 in memory), through
  the Mixtral mapping (:mod:`megazero.convert.hf_mixtral`); written per expert.

Sliding-window attention is refused (megazero attends to the whole sequence), and so is an
export of anything Qwen3 does not compute (biases, a shared expert, sigmoid routing, an expert
bias, a capacity factor that drops tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.convert.hf_mixtral import QWEN_SPLIT, experts_to_split, qwen_router_and_experts
from megazero.convert.hf_qwen2 import sparse_layers

MODEL_TYPES = ("qwen3", "qwen3_moe")
_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))


def config_to_megazero(c: Mapping[str, Any], llama: ModelConfig,
                       refuse: Callable[[str, str], None]) -> ModelConfig:
    """``llama``: the dense part, read from ``c`` as for Llama (``head_dim`` included)."""
    sliding = [i for i, t in enumerate(c.get("layer_types") or ()) if t == "sliding_attention"]
    if sliding or (c.get("use_sliding_window") and c.get("sliding_window")):
        refuse(f"use_sliding_window with sliding_window={c.get('sliding_window')} (layers "
               f"{sliding or 'per max_window_layers'})", "megazero attends to the whole "
               "sequence; set use_sliding_window false")
    dense = replace(llama, qk_layernorm=True,
                    untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False))
    if c["model_type"] == "qwen3":
        return dense
    sparse = sparse_layers(c)
    # the Hub's files say num_experts; transformers 5's to_dict() num_local_experts
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if not experts or not any(sparse):
        return dense  # every layer keeps the dense MLP
    moe = MoEConfig(num_experts=experts,
                    moe_router_topk=int(c["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(c["moe_intermediate_size"]),
                    moe_layer_freq=1 if all(sparse) else sparse,
                    moe_router_pre_softmax=not c.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)))
    return replace(dense, moe=moe)


def config_from_megazero(m: ModelConfig, llama: dict[str, Any],
                         refuse: Callable[[str, str], None]) -> dict[str, Any]:
    """``llama``: the HF Llama config of the dense part (``m`` is the Llama block with
    ``--qk-layernorm``)."""
    moe = m.moe
    problems = [("--add-bias-linear", "Qwen3's linears have no bias") if m.add_bias_linear
                else None,
                ("--add-qkv-bias", "Qwen3's attention has no bias") if m.add_qkv_bias else None]
    if moe.enabled:
        problems += [
            ("--moe-router-score-function sigmoid", "Qwen3-MoE routes by softmax")
            if moe.moe_router_score_function != "softmax" else None,
            ("--moe-router-topk-scaling-factor", "Qwen3-MoE does not scale its weights")
            if moe.moe_router_topk_scaling_factor not in (None, 1.0) else None,
            ("--moe-router-enable-expert-bias", "Qwen3-MoE has no expert bias")
            if moe.moe_router_enable_expert_bias else None,
            ("--moe-shared-expert-intermediate-size", "Qwen3-MoE has no shared expert")
            if moe.moe_shared_expert_intermediate_size is not None else None,
            (f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor}",
             "Qwen3-MoE is dropless") if moe.moe_expert_capacity_factor is not None else None]
    for p in problems:
        if p is not None:
            refuse(*p)
    out = {k: v for k, v in llama.items() if k != "mlp_bias"}
    out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
               max_window_layers=m.num_layers, head_dim=m.head_dim)
    if not moe.enabled:
        return dict(out, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    dense_layers = [i for i in range(m.num_layers) if not moe.is_moe_layer(i, m.num_layers)]
    return dict(out, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                num_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
                moe_intermediate_size=moe.moe_ffn_hidden_size or m.ffn_size,
                norm_topk_prob=not moe.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=dense_layers, router_aux_loss_coef=moe.moe_aux_loss_coeff,
                output_router_logits=False)


def norms_to_megazero(i: int, src: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer ``i``'s query and key norms."""
    return {f"decoder.layers.{i}.self_attention.{mz}.weight":
            src(f"model.layers.{i}.self_attn.{hf}.weight") for hf, mz in _NORMS}


def norms_from_megazero(i: int, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.{hf}.weight":
            get(f"decoder.layers.{i}.self_attention.{mz}.weight") for hf, mz in _NORMS}


def mlp_to_megazero(m: ModelConfig, i: int, src: Callable[[str], torch.Tensor],
                    names: set[str]) -> dict[str, torch.Tensor]:
    """Sparse layer ``i``'s router and experts (either layout)."""
    return qwen_router_and_experts(m, i, src, names)


def mlp_from_megazero(m: ModelConfig, i: int, get: Callable[[str], torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """Sparse layer ``i`` in the per-expert layout (the one every transformers version loads)."""
    e_count = m.moe.num_experts
    assert e_count is not None
    p = f"model.layers.{i}.mlp."
    return {f"{p}gate.weight": get(f"decoder.layers.{i}.mlp.router.weight"),
            **experts_to_split(i, e_count, get, f"{p}experts.", *QWEN_SPLIT)}
