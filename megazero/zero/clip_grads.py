"""Global gradient norm and clipping coefficient over sharded gradients.

The norm is one number for the whole model across every rank. Each rank sums squares over the
gradient elements it *owns*: its data-parallel shard (stages 1-3) or everything (stage 0, whose
full gradients are identical on every data-parallel rank, so only data-parallel rank 0
contributes). A non-finite sum is the overflow / NaN check (see ``ZeroOptimizer.step``). Within a
model-parallel group, duplicate copies are skipped
(:func:`megazero.tensor_parallel.utils.is_duplicate_copy`: parameters replicated across
tensor-parallel ranks count on ``tp_rank == 0`` only, the last stage's copy of a tied embedding
not at all), so every element of the logical model counts exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def sum_of_squares(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """fp32 sum of squares of ``grads`` (one fused reduction per dtype group)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # fp32 accumulation: scaled fp16 gradients routinely have norms above fp16's 65504.
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).pow(2).sum()


def count_zeros(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """How many elements of ``grads`` are exactly zero (float64 scalar: counts past 2**24)."""
    counts = [(g == 0).sum() for g in grads if g.numel()]
    if not counts:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(counts).sum().to(torch.float64)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Scale to apply to every gradient so that the global norm is at most ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    return min(coef, 1.0)
