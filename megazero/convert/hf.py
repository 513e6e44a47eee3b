"""Hugging Face <-> megazero weight and config mapping for three architectures.

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

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megazero.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "gpt_neox", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                         "qwen3_moe")
#: the families whose experts are converted (the module that maps them: _moe_family)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
# Buffers some transformers versions keep in the state dict; they are derived, not weights.
_DERIVED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq",
                     ".attention.bias", ".attention.masked_bias")


class ConversionError(ValueError):
    """A model that cannot be converted exactly; the message names the setting or tensor."""


def _refuse(what: str, why: str) -> None:
    raise ConversionError(f"cannot convert: {what} ({why})")


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


def _rope_theta(c: Mapping[str, Any]) -> float:
    """``rope_theta`` from either config style (``rope_parameters`` in transformers >= 5,
    ``rope_theta`` + ``rope_scaling`` before); any rope type but the default is refused."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for block in (params, scaling):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            _refuse(f"rope scaling rope_type={kind!r}", "megazero implements plain RoPE only")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _check_common(c: Mapping[str, Any]) -> None:
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        _refuse(f"model_type={model_type!r}", f"supported: {SUPPORTED_MODEL_TYPES}")
    # Qwen2 configs keep a window size with use_sliding_window false: no window then
    if c.get("sliding_window") not in (None, 0) and c.get("use_sliding_window", True):
        _refuse(f"sliding_window={c['sliding_window']}", "megazero attends to the full context")
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if c.get(key) and model_type not in MOE_MODEL_TYPES:
            _refuse(f"{key}={c[key]} (mixture of experts)", "megazero imports Mixtral's, "
                    "Qwen2-MoE's and Qwen3-MoE's experts; other MoE families are not converted yet")


def hf_config_to_megazero(c: Mapping[str, Any]) -> ModelConfig:
    """A megazero :class:`ModelConfig` computing the same function as HF config ``c``."""
    _check_common(c)
    tie = bool(c.get("tie_word_embeddings", True))
    if c["model_type"] == "gpt_neox":
        from megazero.convert import hf_neox

        return hf_neox.config_to_megazero(c, _rope_theta(c), _refuse)
    if c["model_type"] == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTIVATIONS:
            _refuse(f"activation_function={act!r}", f"supported: {list(_GPT2_ACTIVATIONS)}")
        if not c.get("scale_attn_weights", True):
            _refuse("scale_attn_weights=False", "megazero scales scores by 1/sqrt(head_dim)")
        if c.get("scale_attn_by_inverse_layer_idx"):
            _refuse("scale_attn_by_inverse_layer_idx=True", "not implemented in megazero")
        if c.get("add_cross_attention"):
            _refuse("add_cross_attention=True", "megazero is decoder-only")
        h, positions = c["n_embd"], c["n_positions"]
        return ModelConfig(
            num_layers=c["n_layer"], hidden_size=h, num_attention_heads=c["n_head"],
            ffn_hidden_size=c.get("n_inner") or 4 * h, seq_length=positions,
            max_position_embeddings=positions, vocab_size=c["vocab_size"],
            position_embedding_type="learned_absolute", normalization="LayerNorm",
            norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)), swiglu=False,
            openai_gelu=_GPT2_ACTIVATIONS[act], add_bias_linear=True,
            untie_embeddings_and_output_weights=not tie,
            attention_dropout=float(c.get("attn_pdrop", 0.1)),
            hidden_dropout=float(c.get("resid_pdrop", 0.1)),
            init_method_std=float(c.get("initializer_range", 0.02)), model_preset="gpt2")
    # llama
    bias = bool(c.get("attention_bias", False))
    if bool(c.get("mlp_bias", False)) != bias:
        _refuse(f"attention_bias={bias} with mlp_bias={not bias}", "megazero's linear biases are "
                "on all linears or none")
    if c.get("hidden_act", "silu") != "silu":
        _refuse(f"hidden_act={c['hidden_act']!r}", "the llama preset uses SwiGLU (silu)")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim")  # Qwen3's (and some Llamas') differ from h / heads
    kv_channels = head_dim if head_dim not in (None, h // heads) else None
    groups = c.get("num_key_value_heads") or heads
    positions = c["max_position_embeddings"]
    llama = ModelConfig(
        num_layers=c["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        kv_channels=kv_channels, num_query_groups=groups if groups != heads else None,
        group_query_attention=groups != heads, ffn_hidden_size=c["intermediate_size"],
        seq_length=positions, max_position_embeddings=positions, vocab_size=c["vocab_size"],
        position_embedding_type="rope", rotary_base=_rope_theta(c), normalization="RMSNorm",
        norm_epsilon=float(c.get("rms_norm_eps", 1e-6)), swiglu=True, add_bias_linear=bias,
        untie_embeddings_and_output_weights=not tie,
        attention_dropout=float(c.get("attention_dropout", 0.0)), hidden_dropout=0.0,
        init_method_std=float(c.get("initializer_range", 0.02)), model_preset="llama")
    if c["model_type"] == "mixtral":
        from megazero.convert import hf_mixtral

        return hf_mixtral.config_to_megazero(c, llama, _refuse)
    if c["model_type"] in ("qwen2", "qwen2_moe"):
        from megazero.convert import hf_qwen2

        return hf_qwen2.config_to_megazero(c, llama, _refuse)
    if c["model_type"] in ("qwen3", "qwen3_moe"):
        from megazero.convert import hf_qwen3

        return hf_qwen3.config_to_megazero(c, llama, _refuse)
    return llama


def megazero_preset(m: ModelConfig) -> str:
    """``gpt2``, ``llama`` or ``gpt_neox``: the HF architecture that computes exactly what ``m``
    computes."""
    from megazero.convert import hf_neox

    if hf_neox.matches(m):
        if m.query_groups != m.num_attention_heads:
            _refuse(f"--num-query-groups {m.query_groups}", "GPT-NeoX has no grouped-query "
                    "attention")
        return "gpt_neox"
    gpt2 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm",
                swiglu=False, add_bias_linear=True)
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 openai_gelu=False, rotary_percent=1.0)
    for name, want in (("gpt2", gpt2), ("llama", llama)):
        if all(getattr(m, k) == v for k, v in want.items()):
            if name == "gpt2" and m.query_groups != m.num_attention_heads:
                _refuse(f"--num-query-groups {m.query_groups}", "GPT-2 has no grouped-query "
                        "attention")
            return name
    neox = dict(position_embedding_type="rope", normalization="LayerNorm", swiglu=False,
                add_bias_linear=True)
    options = {"gpt2": gpt2, "llama": llama, "gpt_neox": neox}
    misses = {name: [f"{k}={getattr(m, k)!r} (needs {v!r})" for k, v in want.items()
                     if getattr(m, k) != v] for name, want in options.items()}
    target = min(misses, key=lambda name: len(misses[name]))
    _refuse(f"model settings {', '.join(misses[target])}",
            f"no HF architecture matches; closest is {target}")
    raise AssertionError  # unreachable


def megazero_config_to_hf(m: ModelConfig) -> dict[str, Any]:
    """The HF config dict (``model_type`` included) of the architecture equal to ``m``."""
    tie = not m.untie_embeddings_and_output_weights
    preset = megazero_preset(m)
    if m.qk_layernorm and preset != "llama":
        _refuse(f"--qk-layernorm with the {preset} block", "Qwen3 and Qwen3-MoE (the Llama "
                "block with query/key RMSNorms) are the architectures with them")
    if preset == "gpt_neox":
        from megazero.convert import hf_neox

        return hf_neox.config_from_megazero(m)
    if preset == "gpt2":
        return dict(
            model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=m.vocab_size,
            n_positions=m.max_positions, n_embd=m.hidden_size, n_layer=m.num_layers,
            n_head=m.num_attention_heads, n_inner=m.ffn_size,
            activation_function="gelu_new" if m.openai_gelu else "gelu",
            layer_norm_epsilon=m.norm_epsilon, resid_pdrop=m.hidden_dropout,
            embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
            initializer_range=m.init_method_std, tie_word_embeddings=tie)
    if m.moe.enabled and preset != "llama":
        _refuse(f"--num-experts with the {preset} block", "Mixtral and Qwen2-MoE (the Llama "
                "block with experts) are the MoE architectures megazero exports")
    llama = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=m.vocab_size,
        hidden_size=m.hidden_size, intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.query_groups,
        head_dim=m.head_dim, max_position_embeddings=m.max_positions, hidden_act="silu",
        rms_norm_eps=m.norm_epsilon, rope_theta=m.rotary_base,
        rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base},
        attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear,
        attention_dropout=m.attention_dropout,
        initializer_range=m.init_method_std, tie_word_embeddings=tie)
    from megazero.convert import hf_qwen2, hf_qwen3

    if m.qk_layernorm:  # Qwen3's query/key norms (its MoE: no shared expert, no biases)
        return hf_qwen3.config_from_megazero(m, llama, _refuse)
    if hf_qwen2.is_qwen2(m) or hf_qwen2.is_qwen2_moe(m):  # QKV biases alone, a shared expert
        return hf_qwen2.config_from_megazero(m, llama, _refuse)
    if m.moe.enabled:
        from megazero.convert import hf_mixtral

        return hf_mixtral.config_from_megazero(m, llama, _refuse)
    return llama


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
    if hf_config["model_type"] == "gpt_neox":
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
        return state[name].detach().to(torch.float32)

    heads, groups, d = m.num_attention_heads, m.query_groups, m.head_dim
    out: dict[str, torch.Tensor] = {}
    vocab = m.vocab_size
    embed = get("embedding.word_embeddings.weight")[:vocab]
    head = get("output_layer.weight")[:vocab] if m.untie_embeddings_and_output_weights else embed
    if cfg["model_type"] == "gpt_neox":
        from megazero.convert import hf_neox

        out = hf_neox.state_from_megazero(m, get, embed, head)
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


def model_config_from_dict(d: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from itself, its ``asdict`` form, or a whole run config (a dict
    with a ``model`` block, as ``config.json`` of a checkpoint); unknown keys are ignored so
    configs written by newer versions still load."""
    if isinstance(d, ModelConfig):
        return d
    if "model" in d and isinstance(d["model"], Mapping):
        d = d["model"]
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})
