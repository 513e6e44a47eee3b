"""Activation recomputation as a policy (a :class:`~megazero.config.RecomputeConfig`) applied
to a built model.

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

from megazero.config import RecomputeConfig
from megazero.model.attention import SelfAttention
from megazero.model.mla import MultiLatentAttention
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.random import RNGStatesTracker, checkpoint
from megazero.tensor_parallel.saved_inputs import SavedInputLayout


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


def apply_recompute(model: nn.Module, recompute: RecomputeConfig) -> nn.Module:
    """Apply ``recompute`` to ``model`` (a :class:`GPTModel`) in place, replacing any policy
    applied before; returns it."""
    block = model.decoder
    n = len(block.layers)
    tracker = block.parallel.rng_tracker
    block.recompute_segments = []
    attentions = [m for m in block.modules()
                  if isinstance(m, (SelfAttention, MultiLatentAttention))]
    for attn in attentions:
        if isinstance(attn.core_attention, RecomputedModule):
            attn.core_attention = attn.core_attention.module
    if recompute.granularity == "selective":
        if "core_attn" in recompute.modules:
            for attn in attentions:
                attn.core_attention = RecomputedModule(attn.core_attention, tracker)
    elif recompute.granularity == "full":
        k = recompute.num_layers
        if recompute.method == "uniform":
            block.recompute_segments = [(i, min(i + k, n)) for i in range(0, n, k)]
        else:  # block
            block.recompute_segments = [(i, i + 1) for i in range(min(k, n))]
    block.saved_inputs = saved_input_layout(recompute, block.parallel)
    return model


def saved_input_layout(recompute: RecomputeConfig, parallel: ParallelContext
                       ) -> SavedInputLayout | None:
    """How full recomputation keeps each group's input (None: whole, on the device)."""
    distribute = (recompute.granularity == "full" and recompute.distribute_saved_activations
                  and parallel.tp_size > 1 and not parallel.sequence_parallel)
    to_host = recompute.granularity == "full" and recompute.cpu_checkpointing
    if not (distribute or to_host):
        return None
    if distribute:
        return SavedInputLayout(parallel.tp_group, parallel.tp_rank, parallel.tp_size, to_host)
    return SavedInputLayout(to_host=True)
