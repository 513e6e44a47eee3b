"""Gradient reductions that tensor parallelism adds before the data-parallel reduction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

if TYPE_CHECKING:
    from megazero.topology import ParallelTopology


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter],
                                      topo: ParallelTopology) -> None:
    """Sum over the TP group the grads of parameters flagged ``sequence_parallel``.

    Under sequence parallelism the norms (and row-parallel biases, position embeddings) are
    replicated but each rank applies them to its own sequence slice, so each rank's gradient
    covers only its slice. One flat all-reduce per dtype keeps this to a single collective.
    """
    if topo.tp_size == 1 or topo.tp_group is None:
        return
    grads = [p.grad for p in params
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for bucket in by_dtype.values():
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=topo.tp_group)
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)
