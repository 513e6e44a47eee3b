"""Hugging Face <-> megazero weight mapping (the config half, which architectures convert and
what each maps to, is :mod:`megazero.convert.hf_config`, re-exported here).

* GPT-2 (``GPT2LMHeadModel``): learned absolute positions, LayerNorm, biases, GELU (HF's
  ``gelu_new`` is megazero's ``--openai-gelu``), tied head. HF stores its linears as ``Conv1D``
  (weight ``[in, out]``), so every weight is transposed.
* Llama (``LlamaForCausalLM``): RoPE (rotate-half, as megazero), RMSNorm, SwiGLU, no biases
  (or biases on every linear: ``attention_bias`` and ``mlp_bias``, megazero's
  ``--add-bias-linear``), grouped-query attention, tied or untied head.
* GPT-NeoX (``GPTNeoXForCausalLM``): RoPE, LayerNorm, GELU, biases, sequential residual; the
  megazero default block with ``--position-embedding-type rope`` (:mod:`megazero.convert.hf_neox`).
* Mixtral, Qwen2 / Qwen2-MoE and Qwen3 / Qwen3-MoE, the Llama block with experts, QKV biases
  or query/key norms (:mod:`megazero.convert.hf_mixtral`, :mod:`megazero.convert.hf_qwen2`,
  :mod:`megazero.convert.hf_qwen3`). A ``head_dim`` other than hidden / heads is
  ``--kv-channels``.

Both directions are pure functions on in-memory state dicts. The megazero side is the *global*
state: the ``state_dict`` names of the model built at tp=1, pp=1 (one ``GPTModel``), fp32, with
the vocabulary dimension unpadded (``vocab_size`` rows); padding is added when that state is
loaded into a model (:func:`megazero.convert.state.load_global_state`).

megazero fuses Q, K and V into one ``linear_qkv`` whose rows are laid out by query group,
``[g0: q heads of g0, k_g0, v_g0][g1: ...]`` (see :mod:`megazero.model.attention`), while HF
keeps ``[Q all heads; K; V]`` (GPT-2's ``c_attn``) or three separate projections (Llama); the
(un)fusing below moves rows between the two orders. Anything that would make the logits differ
(an unknown architecture, biases the preset lacks, rope scaling, sliding windows, experts) is
refused with the name of the offending setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from megazero.config import ModelConfig
from megazero.convert.hf_config import (  # noqa: F401 - the config half, re-exported
    MOE_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    ConversionError,
    _refuse,
    hf_config_to_megazero,
    megazero_config_to_hf,
    megazero_preset,
    model_config_from_dict,
)

# Buffers some transformers versions keep in the state dict; they are derived, not weights.
_DERIVED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq",
                     ".attention.bias", ".attention.masked_bias")


# ---------------------------------------------------------------------------------------------
# fused QKV <-> separate Q, K, V


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
             ) -> torch.Tensor:
    """Rows ``[Q; K; V]`` (head-major) -> megazero's per-query-group layout (weights or biases)."""
    per = heads // groups
    rest = q.shape[1:]
    qg = q.reshape(groups, per * q.shape[0] // heads, *rest)
    kg = k.reshape(groups, k.shape[0] // groups, *rest)
    vg = v.reshape(groups, v.shape[0] // groups, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    per = heads // groups
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# configs


def _moe_family(model_type: str) -> Any:
    """The module mapping the sparse MLP of ``model_type``: ``mlp_to_megazero(m, i, src,
    names)`` and ``mlp_from_megazero(m, i, get)`` for each MoE layer ``i``."""
    from megazero.convert import hf_mixtral, hf_qwen2, hf_qwen3

    return {"qwen2_moe": hf_qwen2, "qwen3_moe": hf_qwen3}.get(model_type, hf_mixtral)


# ---------------------------------------------------------------------------------------------
# weights


class _Source:
    """The HF state with a record of what was read, so unknown tensors are refused by name."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state, self.used = state, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ConversionError(f"cannot convert: tensor {name!r} is missing from the Hugging "
                                  "Face state dict")
        self.used.add(name)
        return self.state[name].detach().to(torch.float32)

    def check_all_used(self) -> None:
        extra = sorted(k for k in self.state if k not in self.used
                       and not k.endswith(_DERIVED_SUFFIXES))
        if extra:
            _refuse(f"tensors {extra[:6]}{' ...' if len(extra) > 6 else ''}",
                    "they have no place in the megazero model (biases the preset lacks?)")


def _layer(i: int, rest: str) -> str:
    return f"decoder.layers.{i}.{rest}"


def hf_to_megazero(hf_config: Mapping[str, Any], hf_state: Mapping[str, torch.Tensor]
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """HF config + state dict -> (megazero ModelConfig, global fp32 state, vocab unpadded)."""
    m = hf_config_to_megazero(hf_config)
    src = _Source(hf_state)
    heads, groups = m.num_attention_heads, m.query_groups
    out: dict[str, torch.Tensor] = {}
    if hf_config["model_type"] == "deepseek_v3":
        from megazero.convert import hf_deepseek_v3

        depths = hf_deepseek_v3.mtp_depths_in(hf_config, set(hf_state))
        if depths:  # DeepSeek's checkpoints keep the MTP modules; transformers' states do not
            m = replace(m, mtp_num_layers=depths)
        out = hf_deepseek_v3.state_to_megazero(m, hf_config, src, set(hf_state))
        head, embed = "lm_head.weight", "model.embed_tokens.weight"
    elif hf_config["model_type"] == "gpt_neox":
        from megazero.convert import hf_neox

        out = hf_neox.state_to_megazero(m, src)
        embed = hf_neox.EMBED
        head = next((h for h in hf_neox.HEAD_NAMES if h in hf_state), hf_neox.HEAD_NAMES[0])
    elif m.model_preset == "gpt2":
        out["embedding.word_embeddings.weight"] = src("transformer.wte.weight")
        out["embedding.position_embeddings.weight"] = src("transformer.wpe.weight")
        for i in range(m.num_layers):
            p = f"transformer.h.{i}."
            for hf, mz in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                for leaf in ("weight", "bias"):
                    out[_layer(i, f"{mz}.{leaf}")] = src(f"{p}{hf}.{leaf}")
            w = src(p + "attn.c_attn.weight").t()
            b = src(p + "attn.c_attn.bias")
            out[_layer(i, "self_attention.linear_qkv.weight")] = fuse_qkv(
                *w.chunk(3, dim=0), heads, groups)
            out[_layer(i, "self_attention.linear_qkv.bias")] = fuse_qkv(
                *b.chunk(3, dim=0), heads, groups)
            for hf, mz in (("attn.c_proj", "self_attention.linear_proj"),
                           ("mlp.c_fc", "mlp.linear_fc1"), ("mlp.c_proj", "mlp.linear_fc2")):
                out[_layer(i, f"{mz}.weight")] = src(f"{p}{hf}.weight").t().contiguous()
                out[_layer(i, f"{mz}.bias")] = src(f"{p}{hf}.bias")
        out["decoder.final_layernorm.weight"] = src("transformer.ln_f.weight")
        out["decoder.final_layernorm.bias"] = src("transformer.ln_f.bias")
        head, embed = "lm_head.weight", "transformer.wte.weight"
    else:
        out["embedding.word_embeddings.weight"] = src("model.embed_tokens.weight")
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            out[_layer(i, "input_layernorm.weight")] = src(p + "input_layernorm.weight")
            out[_layer(i, "pre_mlp_layernorm.weight")] = src(p + "post_attention_layernorm.weight")
            for x in ("weight", "bias") if m.add_bias_linear else ("weight",):
                out[_layer(i, f"self_attention.linear_qkv.{x}")] = fuse_qkv(
                    src(f"{p}self_attn.q_proj.{x}"), src(f"{p}self_attn.k_proj.{x}"),
                    src(f"{p}self_attn.v_proj.{x}"), heads, groups)
                out[_layer(i, f"self_attention.linear_proj.{x}")] = src(f"{p}self_attn.o_proj.{x}")
                if m.moe.is_moe_layer(i, m.num_layers):
                    continue
                out[_layer(i, f"mlp.linear_fc1.{x}")] = torch.cat(
                    [src(f"{p}mlp.gate_proj.{x}"), src(f"{p}mlp.up_proj.{x}")], dim=0)
                out[_layer(i, f"mlp.linear_fc2.{x}")] = src(f"{p}mlp.down_proj.{x}")
            if m.qkv_bias and not m.add_bias_linear:  # Qwen2: biases on q, k, v alone
                out[_layer(i, "self_attention.linear_qkv.bias")] = fuse_qkv(
                    src(f"{p}self_attn.q_proj.bias"), src(f"{p}self_attn.k_proj.bias"),
                    src(f"{p}self_attn.v_proj.bias"), heads, groups)
            if m.qk_layernorm:  # Qwen3
                from megazero.convert.hf_qwen3 import norms_to_megazero

                out.update(norms_to_megazero(i, src))
            if m.moe.is_moe_layer(i, m.num_layers):
                out.update(_moe_family(hf_config["model_type"]).mlp_to_megazero(
                    m, i, src, set(hf_state)))
        out["decoder.final_layernorm.weight"] = src("model.norm.weight")
        head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = src(head)
    elif head in hf_state:  # the tied copy: must be the embedding itself
        if not torch.equal(src(head), src(embed)):
            _refuse("tie_word_embeddings=True with lm_head.weight != the word embedding",
                    "set tie_word_embeddings=False in config.json if the head is separate")
    src.check_all_used()
    return m, {k: v.contiguous() for k, v in out.items()}


def megazero_to_hf(model_config: ModelConfig | Mapping[str, Any],
                   state: Mapping[str, torch.Tensor]
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(megazero ModelConfig, global state) -> (HF config dict, HF state dict).

    The tied GPT-2/Llama head is written as ``lm_head.weight`` equal to the embedding (HF's own
    ``state_dict`` has both names); savers may drop it.
    """
    m = model_config_from_dict(model_config)
    cfg = megazero_config_to_hf(m)

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConversionError(f"cannot convert: tensor {name!r} is missing from the megazero "
                                  "state")
        value = state[name].detach().to(torch.float32)
        if m.apply_layernorm_1p and name.endswith("layernorm.weight"):
            return value + 1  # zero-centred norms (--apply-layernorm-1p) scale by 1 + weight
        return value

    heads, groups, d = m.num_attention_heads, m.query_groups, m.head_dim
    out: dict[str, torch.Tensor] = {}
    vocab = m.vocab_size
    embed = get("embedding.word_embeddings.weight")[:vocab]
    head = get("output_layer.weight")[:vocab] if m.untie_embeddings_and_output_weights else embed
    if cfg["model_type"] == "gpt_neox":
        from megazero.convert import hf_neox

        out = hf_neox.state_from_megazero(m, get, embed, head)
        return cfg, {k: v.contiguous() for k, v in out.items()}
    if cfg["model_type"] == "deepseek_v3":
        from megazero.convert import hf_deepseek_v3

        out = {"model.embed_tokens.weight": embed,
               **hf_deepseek_v3.state_from_megazero(m, get), "lm_head.weight": head,
               **hf_deepseek_v3.mtp_from_megazero(m, get, embed, head)}
        return cfg, {k: v.contiguous() for k, v in out.items()}
    if cfg["model_type"] == "gpt2":
        out["transformer.wte.weight"] = embed
        out["transformer.wpe.weight"] = get("embedding.position_embeddings.weight")
        for i in range(m.num_layers):
            p = f"transformer.h.{i}."
            for hf, mz in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                for leaf in ("weight", "bias"):
                    out[f"{p}{hf}.{leaf}"] = get(_layer(i, f"{mz}.{leaf}"))
            w = split_qkv(get(_layer(i, "self_attention.linear_qkv.weight")), heads, groups, d)
            b = split_qkv(get(_layer(i, "self_attention.linear_qkv.bias")), heads, groups, d)
            out[p + "attn.c_attn.weight"] = torch.cat(w, dim=0).t().contiguous()
            out[p + "attn.c_attn.bias"] = torch.cat(b, dim=0)
            for hf, mz in (("attn.c_proj", "self_attention.linear_proj"),
                           ("mlp.c_fc", "mlp.linear_fc1"), ("mlp.c_proj", "mlp.linear_fc2")):
                out[f"{p}{hf}.weight"] = get(_layer(i, f"{mz}.weight")).t().contiguous()
                out[f"{p}{hf}.bias"] = get(_layer(i, f"{mz}.bias"))
        out["transformer.ln_f.weight"] = get("decoder.final_layernorm.weight")
        out["transformer.ln_f.bias"] = get("decoder.final_layernorm.bias")
    else:
        out["model.embed_tokens.weight"] = embed
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = get(_layer(i, "input_layernorm.weight"))
            out[p + "post_attention_layernorm.weight"] = get(_layer(i, "pre_mlp_layernorm.weight"))
            for x in ("weight", "bias") if m.add_bias_linear else ("weight",):
                q, k, v = split_qkv(get(_layer(i, f"self_attention.linear_qkv.{x}")), heads,
                                    groups, d)
                out[f"{p}self_attn.q_proj.{x}"] = q
                out[f"{p}self_attn.k_proj.{x}"] = k
                out[f"{p}self_attn.v_proj.{x}"] = v
                out[f"{p}self_attn.o_proj.{x}"] = get(_layer(i, f"self_attention.linear_proj.{x}"))
                if m.moe.is_moe_layer(i, m.num_layers):
                    continue
                gate, up = get(_layer(i, f"mlp.linear_fc1.{x}")).chunk(2, dim=0)
                out[f"{p}mlp.gate_proj.{x}"] = gate.contiguous()
                out[f"{p}mlp.up_proj.{x}"] = up.contiguous()
                out[f"{p}mlp.down_proj.{x}"] = get(_layer(i, f"mlp.linear_fc2.{x}"))
            if m.qkv_bias and not m.add_bias_linear:  # Qwen2: biases on q, k, v alone
                q, k, v = split_qkv(get(_layer(i, "self_attention.linear_qkv.bias")), heads,
                                    groups, d)
                out[f"{p}self_attn.q_proj.bias"] = q
                out[f"{p}self_attn.k_proj.bias"] = k
                out[f"{p}self_attn.v_proj.bias"] = v
            if m.qk_layernorm:  # Qwen3
                from megazero.convert.hf_qwen3 import norms_from_megazero

                out.update(norms_from_megazero(i, get))
            if m.moe.is_moe_layer(i, m.num_layers):
                out.update(_moe_family(cfg["model_type"]).mlp_from_megazero(m, i, get))
        out["model.norm.weight"] = get("decoder.final_layernorm.weight")
    out["lm_head.weight"] = head
    return cfg, {k: v.contiguous() for k, v in out.items()}
