"""Hugging Face GPT-NeoX (``GPTNeoXForCausalLM``) <-> megazero: RoPE, LayerNorm, GELU, biases.

That is megazero's default block with ``--position-embedding-type rope`` (the README's demo
model), and exactly GPT-NeoX with ``use_parallel_residual=False`` (attention, then the MLP on
its output, as GPT-2), ``rotary_pct`` being ``--rotary-percent`` (rotate-half on the leading
dims). NeoX's ``query_key_value`` keeps each head's ``[q; k; v]`` rows together, which is
megazero's fused per-query-group layout when every head is its own group, so the weights move
unchanged; NeoX has no grouped-query attention, so ``--num-query-groups`` below the heads is
refused.

The head is written as ``embed_out.weight`` (the name of every NeoX checkpoint on the Hub;
transformers 5 renames it to ``lm_head.weight`` on load) and read under either name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megazero.config import ModelConfig

ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
DERIVED_SUFFIXES = (".attention.bias", ".attention.masked_bias")
HEAD_NAMES = ("embed_out.weight", "lm_head.weight")
EMBED = "gpt_neox.embed_in.weight"
_LAYER_MAP = (("input_layernorm", "input_layernorm"),
              ("post_attention_layernorm", "pre_mlp_layernorm"),
              ("attention.query_key_value", "self_attention.linear_qkv"),
              ("attention.dense", "self_attention.linear_proj"),
              ("mlp.dense_h_to_4h", "mlp.linear_fc1"), ("mlp.dense_4h_to_h", "mlp.linear_fc2"))


def matches(m: ModelConfig) -> bool:
    return (m.position_embedding_type == "rope" and m.normalization == "LayerNorm"
            and not m.swiglu and m.add_bias_linear)


def config_to_megazero(c: Mapping[str, Any], rope_theta: float,
                       refuse: Callable[[str, str], None]) -> ModelConfig:
    """A megazero config computing what NeoX config ``c`` computes; other settings refused."""
    if c.get("use_parallel_residual", True):
        refuse("use_parallel_residual=True", "megazero runs attention and MLP in sequence "
               "(GPT-NeoX with use_parallel_residual=False)")
    act = c.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        refuse(f"hidden_act={act!r}", f"supported: {list(ACTIVATIONS)}")
    if not c.get("attention_bias", True):
        refuse("attention_bias=False", "megazero's linear biases are on all linears or none")
    params = c.get("rope_parameters") or {}
    pct = float(params.get("partial_rotary_factor", c.get("rotary_pct", 0.25)))
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    if (head_dim * pct) % 2 or not (head_dim * pct).is_integer():
        refuse(f"rotary_pct={pct}", f"megazero rotates an even number of each head's "
               f"{head_dim} dims (--rotary-percent)")
    theta = float(params.get("rope_theta", c.get("rotary_emb_base", rope_theta)))
    positions = c["max_position_embeddings"]
    return ModelConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"], ffn_hidden_size=c["intermediate_size"],
        seq_length=positions, max_position_embeddings=positions, vocab_size=c["vocab_size"],
        position_embedding_type="rope", rotary_base=theta, normalization="LayerNorm",
        norm_epsilon=float(c.get("layer_norm_eps", 1e-5)), swiglu=False,
        openai_gelu=ACTIVATIONS[act], add_bias_linear=True,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        attention_dropout=float(c.get("attention_dropout", 0.0)),
        hidden_dropout=float(c.get("hidden_dropout", 0.0)),
        init_method_std=float(c.get("initializer_range", 0.02)), rotary_percent=pct)


def config_from_megazero(m: ModelConfig) -> dict[str, Any]:
    """The NeoX config dict (both the transformers 4 and 5 spellings of the rotary settings)."""
    pct = m.rotary_percent
    return dict(
        model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=m.vocab_size,
        hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size,
        hidden_act="gelu_new" if m.openai_gelu else "gelu", rotary_pct=pct,
        rotary_emb_base=m.rotary_base,
        rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base,
                         "partial_rotary_factor": pct},
        max_position_embeddings=m.max_positions, layer_norm_eps=m.norm_epsilon,
        use_parallel_residual=False, attention_bias=True,
        attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
        initializer_range=m.init_method_std,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights)


def state_to_megazero(m: ModelConfig, src: Callable[[str], torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """NeoX tensors (read through ``src``) -> megazero names; the head is left to the caller."""
    out = {"embedding.word_embeddings.weight": src(EMBED)}
    for i in range(m.num_layers):
        for hf, mz in _LAYER_MAP:
            for leaf in ("weight", "bias"):
                out[f"decoder.layers.{i}.{mz}.{leaf}"] = src(f"gpt_neox.layers.{i}.{hf}.{leaf}")
    for leaf in ("weight", "bias"):
        out[f"decoder.final_layernorm.{leaf}"] = src(f"gpt_neox.final_layer_norm.{leaf}")
    return out


def state_from_megazero(m: ModelConfig, get: Callable[[str], torch.Tensor],
                        embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {EMBED: embed}
    for i in range(m.num_layers):
        for hf, mz in _LAYER_MAP:
            for leaf in ("weight", "bias"):
                out[f"gpt_neox.layers.{i}.{hf}.{leaf}"] = get(f"decoder.layers.{i}.{mz}.{leaf}")
    for leaf in ("weight", "bias"):
        out[f"gpt_neox.final_layer_norm.{leaf}"] = get(f"decoder.final_layernorm.{leaf}")
    if m.untie_embeddings_and_output_weights:
        out["embed_out.weight"] = head
    return out
