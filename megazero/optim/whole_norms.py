"""Squared norms of whole parameters from the pieces ranks hold, for Lamb's trust ratio.

A ZeRO rank holds *pieces* (contiguous ranges) of parameters, a piece may be cut again into
sub-groups, and under tensor parallelism each parameter is a TP slice or a replica. The trust
ratio of every piece must be that of its whole (unsharded) parameter, so that the result does not
depend on the layout. :class:`WholeParamNorms` sums each piece's values into one row per
parameter of this pipeline stage (the stores' parameter order, the same on every rank of the
stage), then:

* over the data-parallel group when the optimizer state is sharded (ZeRO 1-3): each element is
  owned by one dp rank. At stage 0 every replica holds every element, so nothing is summed;
* over the tensor-parallel group, where TP-split parameters (``tensor_model_parallel``) add
  their slices and replicated ones (norms, row-parallel biases) count on TP rank 0 only.

Each pipeline stage holds its own parameters; the tied embedding's two copies (first and last
stage) are equal and each computes the same ratio from its own copy, so no pipeline reduction is
needed. The sums cross the wire on the model's device (NCCL refuses host tensors), as one
``(parameters, 2)`` float64 tensor per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from megazero.distributed.group_comm import GroupComm


class WholeParamNorms:
    def __init__(self, params: Sequence[nn.Parameter], dp: GroupComm | None,
                 tp: GroupComm | None, tp_rank: int, device: torch.device) -> None:
        """``params``: every trainable parameter of this stage in an order all its ranks share;
        ``dp``: the data-parallel group when optimizer state is sharded (None at stage 0);
        ``tp``: the tensor-parallel group (None without TP)."""
        self.index = {id(p): i for i, p in enumerate(params)}
        self.dp, self.tp, self.device = dp, tp, device
        replica = [i for i, p in enumerate(params)
                   if not getattr(p, "tensor_model_parallel", False)]
        self.drop = torch.tensor(replica if tp_rank != 0 else [], dtype=torch.long)

    def __call__(self, owners: Sequence[nn.Parameter], sums: torch.Tensor) -> torch.Tensor:
        """``sums[i]``: the partial sums of a piece of ``owners[i]``; returns, per piece, the
        sums of its whole parameter (collective over the dp and tp groups: every rank of the
        stage calls it once per step, whatever pieces it holds)."""
        rows = torch.tensor([self.index[id(p)] for p in owners], dtype=torch.long)
        total = torch.zeros(len(self.index), 2, dtype=torch.float64)
        if len(rows):
            total.index_add_(0, rows, sums.to(torch.float64))
        total = total.to(self.device)
        if self.dp is not None and self.dp.size > 1:
            self.dp.all_reduce(total, what="lamb_norms")
        if self.tp is not None and self.tp.size > 1:
            if len(self.drop):
                total[self.drop.to(self.device)] = 0.0
            self.tp.all_reduce(total, what="lamb_norms")
        return total.cpu()[rows]

    def max(self, owners: Sequence[nn.Parameter], values: torch.Tensor) -> torch.Tensor:
        """Per piece, the largest of ``values`` (one per piece) over every piece of its whole
        parameter, here and on the other TP ranks (a replica's maximum is its copies'): the
        same collective pattern as the sums, one tensor per step."""
        rows = torch.tensor([self.index[id(p)] for p in owners], dtype=torch.long)
        total = torch.full((len(self.index),), float("-inf"), dtype=torch.float64)
        if len(rows):
            total.scatter_reduce_(0, rows, values.to(torch.float64), reduce="amax")
        total = total.to(self.device)
        if self.tp is not None and self.tp.size > 1:
            import torch.distributed as dist

            self.tp.all_reduce(total, op=dist.ReduceOp.MAX, what="lamb_norms")
        return total.cpu()[rows]
