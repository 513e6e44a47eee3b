"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> megazero's MLA + MoE model.

* attention: multi-head latent attention (:mod:`megazero.model.mla`). ``q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without ``q_lora_rank``),
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` and ``o_proj`` are megazero's
  ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (``linear_q_proj``),
  ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj`` and ``linear_proj``;
  ``qk_nope_head_dim`` is ``--qk-head-dim``, ``qk_rope_head_dim`` ``--qk-pos-emb-head-dim``.
  DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3) ...`` (``rope_interleave``), megazero
  rotates halves: the rotated rows of ``q_b_proj`` (per head) and ``kv_a_proj_with_mqa`` are
  reordered evens-then-odds on import (and back on export), which gives the same ``q.k``.
* YaRN ``rope_parameters`` (``factor``, ``original_max_position_embeddings``, ``mscale``,
  ``mscale_all_dim``, betas 32 / 1): ``--rotary-scaling-factor`` and friends; other rope types
  are refused.
* MoE: the first ``first_k_dense_replace`` layers keep a dense MLP of ``intermediate_size``
  (``--moe-layer-freq`` as a 0/1 list), the others route by sigmoid with the expert bias
  ``e_score_correction_bias`` (``--moe-router-enable-expert-bias``), ``n_group`` /
  ``topk_group`` (``--moe-router-num-groups`` / ``--moe-router-group-topk``), weights
  renormalised (``norm_topk_prob`` True: megazero always renormalises sigmoid top-k > 1) and
  scaled by ``routed_scaling_factor``; ``n_shared_experts`` experts of ``moe_intermediate_size``
  are one ungated shared expert ``n`` times as wide.
* multi-token prediction: DeepSeek's checkpoints keep the MTP modules as extra layers
  ``model.layers.{L + k}`` (transformers drops them): ``enorm``, ``hnorm``, ``eh_proj``, the
  transformer layer's own names, ``shared_head.norm`` (megazero's ``mtp.layers.k.*``:
  ``final_layernorm``, ``transformer_layer.*``) and copies of the embedding and head
  (``embed_tokens``, ``shared_head.head``, checked equal to the model's and written back). When
  a state holds them they are read (``num_nextn_predict_layers`` of them); an export writes
  them when the model has MTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.convert.hf_mixtral import QWEN_SPLIT, experts_to_split, qwen_router_and_experts

MODEL_TYPE = "deepseek_v3"
_ATTN = "self_attention."


def _rope(c: Mapping[str, Any], refuse: Callable[[str, str], None]) -> dict[str, Any]:
    """megazero's rotary fields from ``rope_parameters`` (or the older ``rope_scaling``)."""
    params = dict(c.get("rope_parameters") or {})
    params.update({k: v for k, v in (c.get("rope_scaling") or {}).items() if v is not None})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return dict(rotary_base=theta)
    if kind != "yarn":
        refuse(f"rope_type={kind!r}", "megazero implements plain RoPE and YaRN")
    if params.get("attention_factor") is not None:
        refuse("rope attention_factor", "megazero derives it from factor, mscale and "
               "mscale_all_dim as DeepSeek does")
    for key, want in (("beta_fast", 32), ("beta_slow", 1)):
        if params.get(key) not in (None, want):
            refuse(f"rope {key}={params[key]}", f"megazero's YaRN uses {want}")
    if params.get("truncate", True) is not True:
        refuse("rope truncate=False", "megazero's YaRN rounds the ramp's ends (truncate)")
    factor = float(params["factor"])
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):  # transformers then scales the tables by mscale(factor, 1)
        mscale, all_dim = 1.0, 0.0
    return dict(rotary_base=theta, rotary_scaling_factor=factor, mscale=float(mscale),
                mscale_all_dim=float(all_dim),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def config_to_megazero(c: Mapping[str, Any], refuse: Callable[[str, str], None]) -> ModelConfig:
    if c.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={c['hidden_act']!r}", "DeepSeek-V3's MLPs are SwiGLU (silu)")
    if c.get("attention_bias"):
        refuse("attention_bias=True", "megazero's MLA has biases only with --add-bias-linear "
               "on every linear")
    layers, positions = int(c["num_hidden_layers"]), int(c["max_position_embeddings"])
    heads = int(c["num_attention_heads"])
    if int(c.get("num_key_value_heads") or heads) != heads:
        refuse(f"num_key_value_heads={c['num_key_value_heads']}", "MLA has one key per head")
    experts = int(c.get("n_routed_experts") or 0)
    first_dense = int(c.get("first_k_dense_replace") or 0)
    moe = MoEConfig()
    if experts and first_dense < layers:
        topk = int(c["num_experts_per_tok"])
        if not c.get("norm_topk_prob", True) and topk > 1:
            refuse("norm_topk_prob=False", "megazero renormalises sigmoid top-k weights")
        if c.get("norm_topk_prob", True) and topk == 1:
            refuse("norm_topk_prob=True with num_experts_per_tok=1", "megazero does not "
                   "renormalise a single sigmoid weight")
        groups = int(c.get("n_group") or 1)
        shared = int(c.get("n_shared_experts") or 0)
        moe = MoEConfig(
            num_experts=experts, moe_router_topk=topk,
            moe_ffn_hidden_size=int(c["moe_intermediate_size"]),
            moe_layer_freq=tuple(int(i >= first_dense) for i in range(layers)),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            moe_router_load_balancing_type="none",
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=int(c.get("topk_group") or 1) if groups > 1 else None,
            moe_shared_expert_intermediate_size=int(c["moe_intermediate_size"]) * shared
            if shared else None)
    q_lora = c.get("q_lora_rank")
    return ModelConfig(
        num_layers=layers, hidden_size=int(c["hidden_size"]), num_attention_heads=heads,
        ffn_hidden_size=int(c["intermediate_size"]), seq_length=positions,
        max_position_embeddings=positions, vocab_size=int(c["vocab_size"]),
        position_embedding_type="rope", normalization="RMSNorm",
        norm_epsilon=float(c.get("rms_norm_eps", 1e-6)), swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        attention_dropout=float(c.get("attention_dropout", 0.0)), hidden_dropout=0.0,
        init_method_std=float(c.get("initializer_range", 0.02)), model_preset="llama",
        multi_latent_attention=True, q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(c["kv_lora_rank"]), qk_head_dim=int(c["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
        moe=moe, **_rope(c, refuse))


def config_from_megazero(m: ModelConfig, refuse: Callable[[str, str], None]) -> dict[str, Any]:
    moe = m.moe
    if m.add_bias_linear:
        refuse("--add-bias-linear", "DeepSeek-V3's linears have no bias")
    if m.normalization != "RMSNorm" or not m.swiglu:
        refuse("--normalization LayerNorm or no --swiglu", "DeepSeek-V3 is RMSNorm + SwiGLU")
    dense_layers = [i for i in range(m.num_layers) if not moe.is_moe_layer(i, m.num_layers)]
    first_dense = len(dense_layers)
    if dense_layers != list(range(first_dense)):
        refuse(f"MoE layers {[i for i in range(m.num_layers) if i not in dense_layers]}",
               "DeepSeek-V3's dense layers are the first first_k_dense_replace")
    out: dict[str, Any] = dict(
        model_type=MODEL_TYPE, architectures=["DeepseekV3ForCausalLM"],
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, max_position_embeddings=m.max_positions,
        hidden_act="silu", rms_norm_eps=m.norm_epsilon, attention_bias=False,
        attention_dropout=m.attention_dropout, initializer_range=m.init_method_std,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim,
        qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        head_dim=m.qk_pos_emb_head_dim, rope_interleave=True,
        first_k_dense_replace=first_dense, num_nextn_predict_layers=m.mtp_num_layers or 0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rotary_base}
    if m.rotary_scaling_factor > 1.0:
        rope = {"rope_type": "yarn", "rope_theta": m.rotary_base,
                "factor": m.rotary_scaling_factor, "mscale": m.mscale,
                "mscale_all_dim": m.mscale_all_dim, "beta_fast": 32, "beta_slow": 1,
                "original_max_position_embeddings":
                    m.original_max_position_embeddings or m.max_positions}
    out.update(rope_parameters=rope, rope_theta=m.rotary_base)
    if not moe.enabled:
        return dict(out, n_routed_experts=None, first_k_dense_replace=m.num_layers)
    problems = [
        ("--moe-router-score-function softmax", "DeepSeek-V3 routes by sigmoid")
        if moe.moe_router_score_function != "sigmoid" else None,
        ("--moe-shared-expert-gate", "DeepSeek-V3's shared experts are ungated")
        if moe.moe_shared_expert_gate else None,
        (f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor}",
         "DeepSeek-V3 is dropless") if moe.moe_expert_capacity_factor is not None else None]
    for p in problems:
        if p is not None:
            refuse(*p)
    width = moe.moe_ffn_hidden_size or m.ffn_size
    shared = moe.moe_shared_expert_intermediate_size or 0
    if shared % width:
        refuse(f"--moe-shared-expert-intermediate-size {shared}", "DeepSeek-V3's shared "
               f"experts are a whole number of experts of {width}")
    return dict(out, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
                moe_intermediate_size=width, n_shared_experts=shared // width,
                n_group=moe.moe_router_num_groups or 1, topk_group=moe.moe_router_group_topk or 1,
                routed_scaling_factor=moe.moe_router_topk_scaling_factor or 1.0,
                norm_topk_prob=True)


def _deinterleave(pe: int) -> torch.Tensor:
    """Rows ``[0, 2, 4, ..., 1, 3, 5, ...]``: interleaved pairs -> halves."""
    return torch.cat([torch.arange(0, pe, 2), torch.arange(1, pe, 2)])


def _rope_rows(w: torch.Tensor, heads: int, nope: int, pe: int, order: torch.Tensor
               ) -> torch.Tensor:
    """Reorder the last ``pe`` rows of each of ``heads`` blocks of ``nope + pe`` rows."""
    blocks = w.reshape(heads, nope + pe, *w.shape[1:])
    rot = blocks[:, nope:][:, order]
    return torch.cat([blocks[:, :nope], rot], dim=1).reshape(w.shape)


def attention_to_megazero(m: ModelConfig, i: int, src: Callable[[str], torch.Tensor],
                          interleaved: bool) -> dict[str, torch.Tensor]:
    p, mz = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.{_ATTN}"
    heads, nope, pe = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim
    order = _deinterleave(pe) if interleaved else torch.arange(pe)
    out = {}
    if m.q_lora_rank is None:
        out[mz + "linear_q_proj.weight"] = _rope_rows(src(p + "q_proj.weight"), heads, nope, pe,
                                                      order)
    else:
        out[mz + "linear_q_down_proj.weight"] = src(p + "q_a_proj.weight")
        out[mz + "q_layernorm.weight"] = src(p + "q_a_layernorm.weight")
        out[mz + "linear_q_up_proj.weight"] = _rope_rows(src(p + "q_b_proj.weight"), heads,
                                                         nope, pe, order)
    out[mz + "linear_kv_down_proj.weight"] = _rope_rows(
        src(p + "kv_a_proj_with_mqa.weight"), 1, m.kv_lora_rank, pe, order)
    out[mz + "kv_layernorm.weight"] = src(p + "kv_a_layernorm.weight")
    out[mz + "linear_kv_up_proj.weight"] = src(p + "kv_b_proj.weight")
    out[mz + "linear_proj.weight"] = src(p + "o_proj.weight")
    return out


def attention_from_megazero(m: ModelConfig, i: int, get: Callable[[str], torch.Tensor]
                            ) -> dict[str, torch.Tensor]:
    p, mz = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.{_ATTN}"
    heads, nope, pe = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim
    back = torch.argsort(_deinterleave(pe))  # halves -> interleaved pairs
    out = {}
    if m.q_lora_rank is None:
        out[p + "q_proj.weight"] = _rope_rows(get(mz + "linear_q_proj.weight"), heads, nope, pe,
                                              back)
    else:
        out[p + "q_a_proj.weight"] = get(mz + "linear_q_down_proj.weight")
        out[p + "q_a_layernorm.weight"] = get(mz + "q_layernorm.weight")
        out[p + "q_b_proj.weight"] = _rope_rows(get(mz + "linear_q_up_proj.weight"), heads, nope,
                                                pe, back)
    out[p + "kv_a_proj_with_mqa.weight"] = _rope_rows(get(mz + "linear_kv_down_proj.weight"), 1,
                                                      m.kv_lora_rank, pe, back)
    out[p + "kv_a_layernorm.weight"] = get(mz + "kv_layernorm.weight")
    out[p + "kv_b_proj.weight"] = get(mz + "linear_kv_up_proj.weight")
    out[p + "o_proj.weight"] = get(mz + "linear_proj.weight")
    return out


def _shared(i: int, rest: str) -> str:
    return f"decoder.layers.{i}.mlp.shared_experts.{rest}"


def mlp_to_megazero(m: ModelConfig, i: int, src: Callable[[str], torch.Tensor],
                    names: set[str]) -> dict[str, torch.Tensor]:
    """Layer ``i``'s MLP: dense, or router (with its bias), experts and shared experts."""
    p, mz = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    if not m.moe.is_moe_layer(i, m.num_layers):
        return {mz + "linear_fc1.weight": torch.cat([src(p + "gate_proj.weight"),
                                                     src(p + "up_proj.weight")], dim=0),
                mz + "linear_fc2.weight": src(p + "down_proj.weight")}
    out = qwen_router_and_experts(m, i, src, names)
    out[mz + "router.expert_bias"] = src(p + "gate.e_score_correction_bias")
    if m.moe.moe_shared_expert_intermediate_size:
        s = p + "shared_experts."
        out[_shared(i, "mlp.linear_fc1.weight")] = torch.cat(
            [src(s + "gate_proj.weight"), src(s + "up_proj.weight")], dim=0)
        out[_shared(i, "mlp.linear_fc2.weight")] = src(s + "down_proj.weight")
    return out


def mlp_from_megazero(m: ModelConfig, i: int, get: Callable[[str], torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    p, mz = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    if not m.moe.is_moe_layer(i, m.num_layers):
        gate, up = get(mz + "linear_fc1.weight").chunk(2, dim=0)
        return {p + "gate_proj.weight": gate.contiguous(), p + "up_proj.weight": up.contiguous(),
                p + "down_proj.weight": get(mz + "linear_fc2.weight")}
    e_count = m.moe.num_experts
    assert e_count is not None
    out = {p + "gate.weight": get(mz + "router.weight"),
           p + "gate.e_score_correction_bias": get(mz + "router.expert_bias"),
           **experts_to_split(i, e_count, get, f"{p}experts.", *QWEN_SPLIT)}
    if m.moe.moe_shared_expert_intermediate_size:
        gate, up = get(_shared(i, "mlp.linear_fc1.weight")).chunk(2, dim=0)
        out[p + "shared_experts.gate_proj.weight"] = gate.contiguous()
        out[p + "shared_experts.up_proj.weight"] = up.contiguous()
        out[p + "shared_experts.down_proj.weight"] = get(_shared(i, "mlp.linear_fc2.weight"))
    return out


def mtp_depths_in(c: Mapping[str, Any], names: set[str]) -> int:
    """How many of the config's MTP modules the state holds (DeepSeek's naming)."""
    layers, depths = int(c["num_hidden_layers"]), int(c.get("num_nextn_predict_layers") or 0)
    return sum(1 for k in range(depths) if f"model.layers.{layers + k}.eh_proj.weight" in names)


class _Renamed:
    """A source that reads MTP layer ``L + k``'s transformer layer under the main layers'
    names: ``model.layers.{j}.`` of what the mappings above ask is ``model.layers.{L+k}.``,
    and megazero's ``decoder.layers.{j}.`` prefix becomes ``mtp.layers.{k}.transformer_layer.``
    (j: the main model's last layer, whose kind the MTP layer has)."""

    def __init__(self, fn: Callable[[str], torch.Tensor], j: int, hf_layer: int):
        self.fn, self.j, self.hf_layer = fn, j, hf_layer

    def __call__(self, name: str) -> torch.Tensor:
        return self.fn(name.replace(f"model.layers.{self.j}.", f"model.layers.{self.hf_layer}."))


def _mtp_names(i: int, k: int, d: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = f"decoder.layers.{i}."
    return {f"mtp.layers.{k}.transformer_layer." + n[len(prefix):]: v for n, v in d.items()}


def mtp_to_megazero(m: ModelConfig, src: Callable[[str], torch.Tensor], names: set[str],
                    interleaved: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    last = m.num_layers - 1
    embed, head = src("model.embed_tokens.weight"), src("lm_head.weight")
    for k in range(m.mtp_num_layers or 0):
        n = m.num_layers + k
        p, mz = f"model.layers.{n}.", f"mtp.layers.{k}."
        for hf, ours in (("enorm", "enorm"), ("hnorm", "hnorm"),
                         ("shared_head.norm", "final_layernorm")):
            out[f"{mz}{ours}.weight"] = src(f"{p}{hf}.weight")
        out[mz + "eh_proj.weight"] = src(p + "eh_proj.weight")
        for copy, main in (("embed_tokens.weight", embed), ("shared_head.head.weight", head)):
            if f"{p}{copy}" in names and not torch.equal(src(p + copy), main):
                raise ValueError(f"cannot convert: {p}{copy} differs from the model's own "
                                 "(megazero's MTP shares the embedding and the head)")
        renamed = _Renamed(src, last, n)
        layer = {f"decoder.layers.{last}.input_layernorm.weight":
                 renamed(f"model.layers.{last}.input_layernorm.weight"),
                 f"decoder.layers.{last}.pre_mlp_layernorm.weight":
                 renamed(f"model.layers.{last}.post_attention_layernorm.weight"),
                 **attention_to_megazero(m, last, renamed, interleaved),
                 **mlp_to_megazero(m, last, renamed,
                                   {x.replace(p, f"model.layers.{last}.") for x in names})}
        out.update(_mtp_names(last, k, layer))
    return out


def mtp_from_megazero(m: ModelConfig, get: Callable[[str], torch.Tensor], embed: torch.Tensor,
                      head: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    last = m.num_layers - 1
    for k in range(m.mtp_num_layers or 0):
        n = m.num_layers + k
        p, mz = f"model.layers.{n}.", f"mtp.layers.{k}."

        def ours(name: str, k: int = k) -> torch.Tensor:
            return get(name.replace(f"decoder.layers.{last}.",
                                    f"mtp.layers.{k}.transformer_layer."))

        layer = {f"{p}input_layernorm.weight":
                 ours(f"decoder.layers.{last}.input_layernorm.weight"),
                 f"{p}post_attention_layernorm.weight":
                 ours(f"decoder.layers.{last}.pre_mlp_layernorm.weight"),
                 **attention_from_megazero(m, last, ours), **mlp_from_megazero(m, last, ours)}
        out.update({x.replace(f"model.layers.{last}.", p): v for x, v in layer.items()})
        for hf, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"),
                           ("final_layernorm", "shared_head.norm")):
            out[f"{p}{theirs}.weight"] = get(f"{mz}{hf}.weight")
        out[p + "eh_proj.weight"] = get(mz + "eh_proj.weight")
        out[p + "embed_tokens.weight"] = embed
        out[p + "shared_head.head.weight"] = head
    return out


def state_to_megazero(m: ModelConfig, c: Mapping[str, Any], src: Callable[[str], torch.Tensor],
                      names: set[str]) -> dict[str, torch.Tensor]:
    interleaved = bool(c.get("rope_interleave", True))
    out = {"embedding.word_embeddings.weight": src("model.embed_tokens.weight")}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        out[f"decoder.layers.{i}.input_layernorm.weight"] = src(p + "input_layernorm.weight")
        out[f"decoder.layers.{i}.pre_mlp_layernorm.weight"] = src(
            p + "post_attention_layernorm.weight")
        out.update(attention_to_megazero(m, i, src, interleaved))
        out.update(mlp_to_megazero(m, i, src, names))
    out["decoder.final_layernorm.weight"] = src("model.norm.weight")
    out.update(mtp_to_megazero(m, src, names, interleaved))
    return out


def state_from_megazero(m: ModelConfig, get: Callable[[str], torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = get(f"decoder.layers.{i}.input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = get(
            f"decoder.layers.{i}.pre_mlp_layernorm.weight")
        out.update(attention_from_megazero(m, i, get))
        out.update(mlp_from_megazero(m, i, get))
    out["model.norm.weight"] = get("decoder.final_layernorm.weight")
    return out
