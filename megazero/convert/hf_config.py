"""Hugging Face ``config.json`` <-> megazero :class:`~megazero.config.ModelConfig`: which
architectures convert, the settings each one maps to, and the refusals (one line naming the
setting) for anything that would make the logits differ. The weights are
:mod:`megazero.convert.hf`'s; the families with their own rules are in ``hf_neox``,
``hf_mixtral``, ``hf_qwen2`` and ``hf_qwen3``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megazero.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "gpt_neox", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                         "qwen3_moe", "deepseek_v3")
#: the families whose experts are converted (the module that maps them: _moe_family)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
_GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


class ConversionError(ValueError):
    """A model that cannot be converted exactly; the message names the setting or tensor."""


def _refuse(what: str, why: str) -> None:
    raise ConversionError(f"cannot convert: {what} ({why})")


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
    if c["model_type"] == "deepseek_v3":
        from megazero.convert import hf_deepseek_v3

        return hf_deepseek_v3.config_to_megazero(c, _refuse)
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
    if m.multi_latent_attention:  # MLA: DeepSeek-V3 is the architecture with it
        from megazero.convert import hf_deepseek_v3

        return hf_deepseek_v3.config_from_megazero(m, _refuse)
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
