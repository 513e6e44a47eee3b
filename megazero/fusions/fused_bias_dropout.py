"""Bias + dropout + residual add (Megatron's ``--bias-dropout-fusion``), after the
row-parallel attention projection and fc2, whose bias the layer adds here instead.

Only the no-mask case is compiled (hidden dropout 0, or evaluation): a compiled region draws
random numbers differently from the eager ``native_dropout``, and a run must train the same
model with the fusion on or off, in every parallel layout. With dropout in training the layer
adds the bias, draws the mask eagerly from the RNG tracker's stream and adds the residual, op
for op as without the fusion (:meth:`megazero.model.transformer.TransformerLayer._dropout_add`).
"""

from __future__ import annotations

import torch

from megazero.fusions.compiled import fuse


def bias_add_residual_eager(x: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor) -> torch.Tensor:
    """``residual + (x + bias)``: the bias-dropout-add with no mask drawn."""
    return residual + (x if bias is None else x + bias)


bias_add_residual = fuse(bias_add_residual_eager)
