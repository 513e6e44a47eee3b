"""Bias + SwiGLU (Megatron's ``--bias-swiglu-fusion``): fc1's ``[gate; up]`` product (this
rank's slice of both halves) plus its bias, then ``silu(gate) * up`` in one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.fusions.compiled import fuse


def bias_swiglu_eager(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x + bias`` split in halves along the last dim."""
    if bias is not None:
        x = x + bias
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


bias_swiglu = fuse(bias_swiglu_eager)
