"""Query/key normalisation (Megatron's ``--qk-layernorm``; Qwen3's ``q_norm``/``k_norm``).

The model's ``--normalization`` over each head's ``head_dim`` features of the queries and the
keys, applied after the fused QKV projection and before RoPE. Each norm has one weight of size
``head_dim`` that every head shares, so it is replicated over the tensor-parallel group like
the other norms; but a TP rank holds only its own heads, so its gradient covers only those
heads' contribution. The whole gradient is the sum over the TP group, with or without
sequence parallelism: the weights are flagged ``tp_partial_grad`` and the gradient sync sums
them over TP with the sequence-parallel ones (:func:`megazero.zero.build.deferred_kinds`), as
megatron-core's ``finalize_model_grads`` all-reduces ``q_layernorm``/``k_layernorm`` grads.

Under context parallelism every rank normalises all of its TP rank's heads on its share of the
sequence (Ulysses' head split over CP happens later, inside core attention), so the CP share
of the gradient is reduced with the data-parallel one, like any replicated weight's.
"""

from __future__ import annotations

from torch import nn

from megazero.config import ModelConfig
from megazero.model.init import scope
from megazero.model.norms import build_norm
from megazero.tensor_parallel.context import ParallelContext


def mark_tp_partial_grad(module: nn.Module) -> nn.Module:
    """Flag ``module``'s parameters: replicated over TP, gradient summed over TP."""
    for p in module.parameters():
        p.tp_partial_grad = True
    return module


def build_qk_norms(config: ModelConfig, parallel: ParallelContext
                   ) -> tuple[nn.Module | None, nn.Module | None]:
    """``(q_layernorm, k_layernorm)`` over ``head_dim``, or ``(None, None)`` without
    ``--qk-layernorm``. Their init rules are keyed ``q_layernorm``/``k_layernorm`` (unit
    weights, as every norm), so they do not depend on the layout."""
    if not config.qk_layernorm:
        return None, None
    norms = []
    for name in ("q_layernorm", "k_layernorm"):
        norm = build_norm(config.normalization, config.head_dim, config.norm_epsilon, False,
                          parallel.params_dtype, config.apply_layernorm_1p)
        norms.append(scope(mark_tp_partial_grad(norm), name))
    return norms[0], norms[1]
