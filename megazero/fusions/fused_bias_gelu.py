"""Bias + GELU (Megatron's ``--bias-gelu-fusion``): the column-parallel fc1 returns its
product without the bias, and one kernel adds the bias and applies GELU (backward: one kernel
for the input grad, the bias grad reduced from it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.fusions.compiled import fuse


def bias_gelu_eager(x: torch.Tensor, bias: torch.Tensor | None,
                    approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``; ``approximate`` is ``"tanh"`` with ``--openai-gelu`` (GPT-2's
    gelu_new), ``"none"`` for the exact erf form."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


bias_gelu = fuse(bias_gelu_eager)
