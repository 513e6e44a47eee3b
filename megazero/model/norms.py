"""LayerNorm and RMSNorm, flagged for sequence-parallel gradient reduction; with Megatron's
``--apply-layernorm-1p`` their weights are zero-centred (stored ``w``, applied as ``1 + w``, and
initialised to 0), so weight decay pulls them toward the identity scale instead of toward 0."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.model.init import declare_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 one_plus: bool = False):
        super().__init__()
        self.eps = eps
        self.one_plus = one_plus
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.one_plus else self.weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm scaling by ``1 + weight`` (Megatron's ``apply_layernorm_1p``)."""

    one_plus = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool,
               dtype: torch.dtype = torch.float32, one_plus: bool = False) -> nn.Module:
    """A norm over the last dim. Under sequence parallelism each rank normalises only its
    sequence slice, so its weight/bias grads are partial: they are flagged
    ``sequence_parallel``, and the gradient sync sums them over the tensor-parallel group
    (:meth:`megazero.zero.ZeroOptimizer.finish_grad_sync`). ``one_plus``: zero-centred
    weights (``--apply-layernorm-1p``)."""
    if kind == "LayerNorm":
        cls = LayerNorm1P if one_plus else nn.LayerNorm
        norm: nn.Module = cls(hidden_size, eps=eps, dtype=dtype)
    elif kind == "RMSNorm":
        norm = RMSNorm(hidden_size, eps=eps, dtype=dtype, one_plus=one_plus)
    else:
        raise ValueError(f"unknown normalization {kind!r}; expected LayerNorm or RMSNorm")
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel
    return declare_norm(norm, zero_centred=one_plus)
