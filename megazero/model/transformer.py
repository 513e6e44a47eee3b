"""Transformer layer (pre-norm) and the block of layers held by one pipeline chunk."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.fusions import bias_add_residual, use_fusion
from megazero.model.attention import SelfAttention
from megazero.model.dropout import dropout
from megazero.model.init import scope
from megazero.model.mlp import MLP
from megazero.model.norms import build_norm
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.layers import RowParallelLinear
from megazero.tensor_parallel.random import DEFAULT_STREAM, MODEL_PARALLEL_STREAM, checkpoint
from megazero.tensor_parallel.saved_inputs import SavedInputLayout


def build_mlp(config: ModelConfig, layer_number: int, parallel: ParallelContext) -> nn.Module:
    """The dense MLP, or an MoE block on the layers ``--moe-layer-freq`` chooses (a
    multi-token-prediction layer, numbered after the last, as the last layer)."""
    if config.moe.is_moe_layer(min(layer_number, config.num_layers - 1), config.num_layers):
        from megazero.moe.moe_layer import MoELayer  # the MoE package builds on this one

        return MoELayer(config, parallel=parallel, layer_number=layer_number)
    return MLP(config, parallel=parallel)


def build_attention(config: ModelConfig, parallel: ParallelContext) -> nn.Module:
    """Self-attention, or multi-head latent attention with ``--multi-latent-attention``."""
    if config.multi_latent_attention:
        from megazero.model.mla import MultiLatentAttention

        return MultiLatentAttention(config, parallel=parallel)
    return SelfAttention(config, parallel=parallel)


def _biased_row_linear(module: nn.Module, name: str) -> RowParallelLinear | None:
    """``module.<name>`` when it is a row-parallel linear with a bias (the attention
    projection, the dense MLP's fc2; an MoE block has none): the bias the layer can fuse."""
    linear = getattr(module, name, None)
    return linear if isinstance(linear, RowParallelLinear) and linear.bias is not None else None


@contextmanager
def _residual_fused(linear: RowParallelLinear | None, residual: torch.Tensor) -> Iterator[None]:
    """Inside the block ``linear`` returns ``residual + (product + bias)`` in one compiled
    kernel (its epilogue, run inside its forward, where ZeRO-3 holds the gathered bias); only
    for this call, so other callers (generation) keep the plain forward."""
    if linear is None:
        yield
        return
    linear.epilogue = lambda y, bias: bias_add_residual(y, bias, residual)
    try:
        yield
    finally:
        linear.epilogue = None


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
                parallel.params_dtype, config.apply_layernorm_1p)
        self.input_layernorm = build_norm(*norm)
        self.self_attention = build_attention(config, parallel)
        self.pre_mlp_layernorm = build_norm(*norm)
        self.mlp = build_mlp(config, layer_number, parallel)
        for child, name in ((self.input_layernorm, "input_layernorm"),
                            (self.self_attention, "self_attention"),
                            (self.pre_mlp_layernorm, "pre_mlp_layernorm"), (self.mlp, "mlp")):
            scope(child, name)
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.fusions_on_cpu = config.fusions_on_cpu

    def _dropout_add(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            with self.parallel.fork(self.dropout_stream):
                out = dropout(out, self.hidden_dropout)
        return residual + out

    def _fused_output(self, x: torch.Tensor, module: nn.Module, name: str
                      ) -> RowParallelLinear | None:
        """The output linear whose epilogue is the fused bias-dropout-add for this call,
        or None for the unfused path: the fusion is on (:func:`megazero.fusions.use_fusion`),
        there is a bias to fuse, and no dropout mask is drawn (a compiled region would draw
        other random numbers than the eager dropout, see :mod:`megazero.fusions`)."""
        if self.training and self.hidden_dropout > 0:
            return None
        if not use_fusion(self.bias_dropout_fusion, x, self.fusions_on_cpu):
            return None
        return _biased_row_linear(module, name)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        proj = self._fused_output(x, self.self_attention, "linear_proj")
        with _residual_fused(proj, x):
            out = self.self_attention(self.input_layernorm(x), rotary)
        x = out if proj else self._dropout_add(out, x)
        fc2 = self._fused_output(x, self.mlp, "linear_fc2")
        with _residual_fused(fc2, x):
            out = self.mlp(self.pre_mlp_layernorm(x))
        return out if fc2 else self._dropout_add(out, x)


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
            parallel.sequence_parallel, parallel.params_dtype,
            config.apply_layernorm_1p) if post_process else None
        if self.final_layernorm is not None:
            scope(self.final_layernorm, "final_layernorm")
        self.recompute_segments: list[tuple[int, int]] = []
        self.saved_inputs: SavedInputLayout | None = None  # how a segment keeps its input

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
                               tracker=self.parallel.rng_tracker, saved=self.saved_inputs)
            i = last
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
