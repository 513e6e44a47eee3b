"""LayerNorm and RMSNorm, flagged for sequence-parallel gradient reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.model.init import declare_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """A norm over the last dim. Under sequence parallelism each rank normalises only its
    sequence slice, so its weight/bias grads are partial: they are flagged
    ``sequence_parallel``, and the gradient sync sums them over the tensor-parallel group
    (:meth:`megazero.zero.ZeroOptimizer.finish_grad_sync`)."""
    if kind == "LayerNorm":
        norm: nn.Module = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
    elif kind == "RMSNorm":
        norm = RMSNorm(hidden_size, eps=eps, dtype=dtype)
    else:
        raise ValueError(f"unknown normalization {kind!r}; expected LayerNorm or RMSNorm")
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel
    return declare_norm(norm)
