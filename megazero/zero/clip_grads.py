"""Global gradient norm, clipping coefficient and overflow detection over sharded gradients.

The norm is one number for the whole model across every rank. Each rank sums squares over the
gradient elements it *owns*: its data-parallel shard (stages 1-3) or everything (stage 0, whose
full gradients are identical on every data-parallel rank and so are not summed over dp). Within a
model-parallel group, parameters replicated across tensor-parallel ranks are counted on
``tp_rank == 0`` only and the last stage's copy of a tied embedding (``shared=True``) is skipped,
so every element of the logical model counts exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megazero.zero.comm import GroupComm


def counts_in_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` contributes to the global norm."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def sum_of_squares(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """fp32 sum of squares of ``grads`` (one fused reduction per dtype group)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # fp32 accumulation: scaled fp16 gradients routinely have norms above fp16's 65504.
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).pow(2).sum()


def all_reduce_scalar(value: torch.Tensor, comms: list[GroupComm], op: Any = None,
                      device: torch.device | None = None) -> float:
    """Sum (or ``op``) a scalar over each group in ``comms``, in order; return it as a float.

    ``device``: where the reduction happens (the model's device; NCCL needs a CUDA tensor even
    when the value was computed on the host, as with offloaded gradients)."""
    t = value.detach().reshape(1).to(device=device or value.device, dtype=torch.float32,
                                      copy=True)
    for c in comms:
        c.all_reduce(t, op=op or dist.ReduceOp.SUM, what="scalar")
    return float(t.item())


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Scale to apply to every gradient so that the global norm is at most ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    return min(coef, 1.0)


def has_inf_or_nan(grads: Iterable[torch.Tensor]) -> bool:
    """True if any local gradient element is inf or nan (checked with one sum per tensor)."""
    for g in grads:
        if g.numel() and not torch.isfinite(g.float().sum()):
            return True
    return False
