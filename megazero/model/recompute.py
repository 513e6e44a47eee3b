"""Activation recomputation as a policy applied to a built model.

``full``: whole layers run under :func:`megazero.tensor_parallel.random.checkpoint`; only the
layer-group input is kept. ``uniform`` checkpoints consecutive groups of ``num_layers`` layers
(each group keeps one input); ``block`` checkpoints the first ``num_layers`` layers of the chunk
one by one and leaves the rest alone (spend memory saved on early stages, which hold the most
in-flight micro-batches).

``selective``: only the core attention (scores, softmax, dropout, ``@V``) is recomputed; its
``O(a s^2)`` activations are the largest and cheapest to rebuild (Korthikanti et al., 2022).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.tensor_parallel.random import RNGStatesTracker, checkpoint


class RecomputedModule(nn.Module):
    """Runs ``module`` under checkpoint. Holds no parameters of its own, and wraps modules
    without parameters (core attention), so parameter names do not change."""

    def __init__(self, module: nn.Module, tracker: RNGStatesTracker):
        super().__init__()
        self.module = module
        self.tracker = tracker

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if not self.training or not torch.is_grad_enabled():
            return self.module(*args)
        return checkpoint(self.module, *args, tracker=self.tracker)


def apply_recompute(model: nn.Module, granularity: str | None, method: str | None = None,
                    num_layers: int | None = None) -> nn.Module:
    """Apply a recomputation policy to ``model`` (a :class:`GPTModel`) in place; returns it."""
    block = model.decoder
    n = len(block.layers)
    block.recompute_segments = []
    for layer in block.layers.values():
        attn = layer.self_attention
        if isinstance(attn.core_attention, RecomputedModule):
            attn.core_attention = attn.core_attention.module
    if granularity is None:
        return model
    if granularity == "selective":
        for layer in block.layers.values():
            attn = layer.self_attention
            attn.core_attention = RecomputedModule(attn.core_attention, block.tracker)
        return model
    if granularity != "full":
        raise ValueError(f"recompute granularity {granularity!r}: expected full or selective")
    k = n if num_layers is None else num_layers
    if k < 1:
        raise ValueError(f"recompute_num_layers must be >= 1, got {k}")
    if method == "uniform":
        block.recompute_segments = [(i, min(i + k, n)) for i in range(0, n, k)]
    elif method == "block":
        block.recompute_segments = [(i, i + 1) for i in range(min(k, n))]
    else:
        raise ValueError(f"recompute method {method!r}: expected uniform or block")
    return model
