"""Transformer layer (pre-norm) and the block of layers held by one pipeline chunk."""

from __future__ import annotations

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.model.attention import SelfAttention
from megazero.model.dropout import dropout
from megazero.model.init import scope
from megazero.model.mlp import MLP
from megazero.model.norms import build_norm
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.random import DEFAULT_STREAM, MODEL_PARALLEL_STREAM, checkpoint


def build_mlp(config: ModelConfig, layer_number: int, parallel: ParallelContext) -> nn.Module:
    """The dense MLP, or an MoE block on the layers ``--moe-layer-freq`` chooses."""
    if config.moe.is_moe_layer(layer_number, config.num_layers):
        from megazero.moe.moe_layer import MoELayer  # the MoE package builds on this one

        return MoELayer(config, parallel=parallel, layer_number=layer_number)
    return MLP(config, parallel=parallel)


class TransformerLayer(nn.Module):
    """``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))`` on ``[s(/t), b, h]``.

    Hidden dropout acts on replicated activations without sequence parallelism (default
    stream: identical masks on every TP rank) and on sequence slices with it (model-parallel
    stream: each rank draws the mask of its own slice).
    """

    def __init__(self, config: ModelConfig, layer_number: int, *,
                 parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.layer_number = layer_number  # global index in the full model
        self.hidden_dropout = config.hidden_dropout
        self.parallel = parallel
        sp = parallel.sequence_parallel
        self.dropout_stream = MODEL_PARALLEL_STREAM if sp else DEFAULT_STREAM
        norm = (config.normalization, config.hidden_size, config.norm_epsilon, sp,
                parallel.params_dtype)
        self.input_layernorm = build_norm(*norm)
        self.self_attention = SelfAttention(config, parallel=parallel)
        self.pre_mlp_layernorm = build_norm(*norm)
        self.mlp = build_mlp(config, layer_number, parallel)
        for child, name in ((self.input_layernorm, "input_layernorm"),
                            (self.self_attention, "self_attention"),
                            (self.pre_mlp_layernorm, "pre_mlp_layernorm"), (self.mlp, "mlp")):
            scope(child, name)

    def _dropout_add(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            with self.parallel.fork(self.dropout_stream):
                out = dropout(out, self.hidden_dropout)
        return residual + out

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        x = self._dropout_add(self.self_attention(self.input_layernorm(x), rotary), x)
        return self._dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)


class TransformerBlock(nn.Module):
    """Layers ``[start, end)`` of the full model, keyed by their global index (so parameter
    names, and hence seeds and checkpoints, do not depend on the pipeline split), plus the
    final norm when this chunk is the last.

    ``recompute_segments`` (set by :func:`megazero.model.recompute.apply_recompute`) lists
    ``(first, last)`` local index ranges run under activation checkpointing.
    """

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], *,
                 parallel: ParallelContext | None = None, post_process: bool = True):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        self.layers = nn.ModuleDict({
            str(i): scope(TransformerLayer(config, i, parallel=parallel), f"layers.{i}")
            for i in range(*layer_range)
        })
        self.final_layernorm = build_norm(
            config.normalization, config.hidden_size, config.norm_epsilon,
            parallel.sequence_parallel, parallel.params_dtype) if post_process else None
        if self.final_layernorm is not None:
            scope(self.final_layernorm, "final_layernorm")
        self.recompute_segments: list[tuple[int, int]] = []

    def _run(self, layers: list[nn.Module]):
        def run(x, *rotary):
            for layer in layers:
                x = layer(x, rotary or None)
            return x
        return run

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        layers = list(self.layers.values())
        extra = tuple(rotary) if rotary is not None else ()
        segments = self.recompute_segments if self.training else []
        i = 0
        for first, last in [*segments, (len(layers), len(layers))]:
            if i < first:
                x = self._run(layers[i:first])(x, *extra)
            if first < last:
                if not x.requires_grad:
                    # The reentrant checkpoint only reaches parameters through its inputs'
                    # graph; an input without grad would silently drop the layers' grads.
                    x = x.detach().requires_grad_()
                x = checkpoint(self._run(layers[first:last]), x, *extra,
                               tracker=self.parallel.rng_tracker)
            i = last
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
