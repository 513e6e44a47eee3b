"""Hugging Face Qwen2 (``Qwen2ForCausalLM``) and Qwen2-MoE (``Qwen2MoeForCausalLM``) <->
megazero's Llama block.

Qwen2 is Llama with a bias on the q/k/v projections only: megazero's ``--disable-bias-linear
--add-qkv-bias`` (the three biases fuse into ``linear_qkv.bias`` like the weights). Its
embeddings are untied unless the config ties them.

Qwen2-MoE replaces the MLP of some layers by a sparse block (the others keep a dense MLP of
``intermediate_size``):

* which layers: layer ``i`` is sparse when ``i`` is not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``; megazero's ``--moe-layer-freq`` counts ``i % N``, so
  anything but every layer becomes its 0/1 list form. Exported as ``decoder_sparse_step=1`` with
  the dense layers in ``mlp_only_layers``, which says the same for any pattern.
* router ``mlp.gate``: a softmax over all experts, then the top ``num_experts_per_tok``;
  ``norm_topk_prob`` False keeps those full-softmax probabilities (``--moe-router-pre-softmax``),
  True renormalises them to sum 1, which is the softmax of the top-k logits (megazero's default).
* experts ``mlp.experts.<e>.{gate,up,down}_proj`` (the files) or fused ``gate_up_proj`` /
  ``down_proj`` (transformers 5 in memory): the Mixtral mapping
  (:mod:`megazero.convert.hf_mixtral`).
* shared expert ``mlp.shared_expert.*`` scaled by ``sigmoid(mlp.shared_expert_gate(x))``:
  ``--moe-shared-expert-intermediate-size`` with ``--moe-shared-expert-gate``; megazero's
  ``shared_experts.mlp.linear_fc1`` is ``[gate; up]``, ``shared_experts.gate_weight`` the gate.

Sliding-window attention is refused (megazero attends to the whole sequence).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.convert.hf_mixtral import QWEN_SPLIT, experts_to_split, qwen_router_and_experts

MODEL_TYPES = ("qwen2", "qwen2_moe")


def is_qwen2(m: ModelConfig) -> bool:
    """A megazero model Qwen2 computes: the Llama block with biases on QKV alone."""
    return m.add_qkv_bias and not m.add_bias_linear and not m.moe.enabled


def is_qwen2_moe(m: ModelConfig) -> bool:
    """An MoE model to export as Qwen2-MoE rather than Mixtral: it has a shared expert."""
    return m.moe.enabled and m.moe.moe_shared_expert_intermediate_size is not None


def sparse_layers(c: Mapping[str, Any]) -> tuple[int, ...]:
    layers, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step", 1))
    dense = set(c.get("mlp_only_layers") or ())
    if step < 1:
        return (0,) * layers
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))


def config_to_megazero(c: Mapping[str, Any], llama: ModelConfig,
                       refuse: Callable[[str, str], None]) -> ModelConfig:
    """``llama``: the dense part, read from ``c`` as for Llama."""
    sliding = [i for i, t in enumerate(c.get("layer_types") or ()) if t == "sliding_attention"]
    if sliding or (c.get("use_sliding_window") and c.get("sliding_window")):
        refuse(f"use_sliding_window with sliding_window={c.get('sliding_window')} (layers "
               f"{sliding or 'per max_window_layers'})", "megazero attends to the whole "
               "sequence; set use_sliding_window false")
    qkv_bias = bool(c.get("qkv_bias", True))  # Qwen2 always; Qwen2-MoE unless the config says
    dense = replace(llama, add_bias_linear=False, add_qkv_bias=qkv_bias,
                    untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False))
    if c["model_type"] == "qwen2":
        return dense
    sparse = sparse_layers(c)
    if not int(c.get("num_experts") or 0) or not any(sparse):
        return dense  # every layer keeps the dense MLP
    if not c.get("shared_expert_intermediate_size"):
        refuse(f"shared_expert_intermediate_size={c.get('shared_expert_intermediate_size')}",
               "Qwen2-MoE's sparse block always has a shared expert; a zero-width one has no "
               "megazero equivalent")
    moe = MoEConfig(num_experts=int(c["num_experts"]),
                    moe_router_topk=int(c["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(c["moe_intermediate_size"]),
                    moe_layer_freq=1 if all(sparse) else sparse,
                    moe_router_pre_softmax=not c.get("norm_topk_prob", False),
                    moe_shared_expert_intermediate_size=int(c["shared_expert_intermediate_size"]),
                    moe_shared_expert_gate=True,
                    moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)))
    return replace(dense, moe=moe)


def config_from_megazero(m: ModelConfig, llama: dict[str, Any],
                         refuse: Callable[[str, str], None]) -> dict[str, Any]:
    """``llama``: the HF Llama config of the dense part (``m`` is the Llama block)."""
    if m.add_bias_linear:
        refuse("--add-bias-linear", "Qwen2's output projection and MLPs have no bias; only "
               "--add-qkv-bias maps")
    out = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    if not m.moe.enabled:
        return dict(out, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    moe = m.moe
    assert moe.num_experts is not None and moe.moe_shared_expert_intermediate_size is not None
    problems = [("--moe-router-score-function sigmoid", "Qwen2-MoE routes by softmax")
                if moe.moe_router_score_function != "softmax" else None,
                ("--moe-router-topk-scaling-factor", "Qwen2-MoE does not scale its weights")
                if moe.moe_router_topk_scaling_factor not in (None, 1.0) else None,
                ("--moe-router-enable-expert-bias", "Qwen2-MoE has no expert bias")
                if moe.moe_router_enable_expert_bias else None,
                ("--moe-shared-expert-intermediate-size without --moe-shared-expert-gate",
                 "Qwen2-MoE gates its shared expert by sigmoid(x g^T); add the gate")
                if not moe.moe_shared_expert_gate else None]
    for p in problems:
        if p is not None:
            refuse(*p)
    dense_layers = [i for i in range(m.num_layers) if not moe.is_moe_layer(i, m.num_layers)]
    return dict(out, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                qkv_bias=m.add_qkv_bias, num_experts=moe.num_experts,
                num_experts_per_tok=moe.moe_router_topk,
                moe_intermediate_size=moe.moe_ffn_hidden_size or m.ffn_size,
                shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
                norm_topk_prob=not moe.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=dense_layers, router_aux_loss_coef=moe.moe_aux_loss_coeff,
                output_router_logits=False)


def _shared(i: int, rest: str) -> str:
    return f"decoder.layers.{i}.mlp.shared_experts.{rest}"


def mlp_to_megazero(m: ModelConfig, i: int, src: Callable[[str], torch.Tensor],
                    names: set[str]) -> dict[str, torch.Tensor]:
    """Sparse layer ``i``'s router, experts (either layout) and gated shared expert."""
    p = f"model.layers.{i}.mlp."
    s = f"{p}shared_expert."
    return {**qwen_router_and_experts(m, i, src, names),
            _shared(i, "mlp.linear_fc1.weight"): torch.cat(
                [src(s + "gate_proj.weight"), src(s + "up_proj.weight")], dim=0),
            _shared(i, "mlp.linear_fc2.weight"): src(s + "down_proj.weight"),
            _shared(i, "gate_weight"): src(p + "shared_expert_gate.weight")}


def mlp_from_megazero(m: ModelConfig, i: int, get: Callable[[str], torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """Sparse layer ``i`` in the per-expert layout (the one every transformers version loads)."""
    e_count = m.moe.num_experts
    assert e_count is not None
    p = f"model.layers.{i}.mlp."
    gate, up = get(_shared(i, "mlp.linear_fc1.weight")).chunk(2, dim=0)
    return {f"{p}gate.weight": get(f"decoder.layers.{i}.mlp.router.weight"),
            **experts_to_split(i, e_count, get, f"{p}experts.", *QWEN_SPLIT),
            f"{p}shared_expert.gate_proj.weight": gate.contiguous(),
            f"{p}shared_expert.up_proj.weight": up.contiguous(),
            f"{p}shared_expert.down_proj.weight": get(_shared(i, "mlp.linear_fc2.weight")),
            f"{p}shared_expert_gate.weight": get(_shared(i, "gate_weight"))}
