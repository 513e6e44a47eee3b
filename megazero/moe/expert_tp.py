"""Expert tensor parallelism: each expert's fc1 split by columns and fc2 by rows over the
expert-tensor-parallel (``etp``) group (``--expert-tensor-parallel-size``).

After a dispatcher has brought a rank the rows its local experts compute, every rank of the
``etp`` group holds a different set of rows for the same experts, and each holds only a slice of
every expert. :class:`ExpertTensorParallelRegion` makes the computation whole:

* ``gather``: the group's rows are all-gathered (variable counts: each rank's rows are padded to
  the group's largest count, gathered, and the padding dropped) and re-ordered from
  ``(source rank, local expert)`` to ``(local expert, source rank)``, so that the experts see
  their rows contiguously; every rank of the group then holds the same rows;
* the experts compute a partial output from their slice (fc1's columns, the activation, fc2's
  rows): the sum over the group of the partial outputs is the expert's output;
* ``scatter``: the partial outputs go back to ``(source, expert)`` order and are
  reduce-scattered, so each rank receives the summed output of its own rows.

Both are autograd-aware: the adjoint of the gather is a reduce-scatter and of the scatter an
all-gather, so every rank of the group sees the same output gradient for every gathered row.
That is what makes a bias that the group holds whole (fc2's) simple: it is added on group rank 0
only (:func:`add_once`), and its gradient, the sum over every gathered row, is the same on each
rank, so the copies stay equal without a reduction of their own.

Megatron's dispatchers do the same with ``gather_from_sequence_parallel_region`` /
``reduce_scatter_to_sequence_parallel_region`` over its expert tensor group, with split sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megazero.distributed.collectives import Group, group_rank, group_size
from megazero.moe.token_dispatcher import chunk_order
from megazero.tensor_parallel.mappings import (
    all_gather_dim0,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class ExpertTensorParallelRegion:
    """One MoE layer call's gather and scatter over ``etp_group`` (None or one rank: both are the
    identity)."""

    def __init__(self, etp_group: Group) -> None:
        self.group = etp_group
        self._state: tuple[torch.Tensor, int, int] | None = None

    @property
    def active(self) -> bool:
        return group_size(self.group) > 1

    def gather(self, rows: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """``rows`` (sorted by local expert, ``counts`` per expert) from every rank of the group,
        as ``(rows sorted by expert then source rank, counts per expert)``."""
        if not self.active:
            return rows, counts
        mine = torch.tensor([counts], dtype=torch.long, device=rows.device)
        every = all_gather_dim0(mine, self.group).cpu()  # [etp, local experts]
        per_rank = every.sum(dim=1)
        stride = int(per_rank.max())
        padded = F.pad(rows, (0, 0, 0, stride - rows.shape[0]))
        gathered = gather_from_sequence_parallel_region(padded, self.group)
        order = chunk_order(every, stride).to(rows.device)  # (expert, source) order
        self._state = (order, stride, rows.shape[0])
        return gathered.index_select(0, order), every.sum(dim=0).tolist()

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        """Partial outputs of the gathered rows (``gather``'s order) summed over the group;
        returns this rank's own rows in the order it passed them to ``gather``."""
        if not self.active:
            return out
        assert self._state is not None, "scatter before gather"
        order, stride, n = self._state
        self._state = None
        full = out.new_zeros(stride * group_size(self.group), out.shape[-1])
        full = full.index_copy(0, order, out)
        return reduce_scatter_to_sequence_parallel_region(full, self.group)[:n]


class _AddOnce(torch.autograd.Function):
    """``x + b`` on group rank 0, ``x`` elsewhere; the bias gradient is ``dy`` summed on every
    rank (all ranks hold the same ``dy``: see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.bias_shape = bias.shape
        return x + bias if keep else x.clone()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return dy, dy.sum_to_size(ctx.bias_shape), None


def add_once(x: torch.Tensor, bias: torch.Tensor, etp_group: Group) -> torch.Tensor:
    """Add ``bias`` (held whole by every rank of ``etp_group``) to a partial output so that the
    reduce-scatter over the group adds it once."""
    if group_size(etp_group) == 1:
        return x + bias
    out: torch.Tensor = _AddOnce.apply(  # type: ignore[no-untyped-call]
        x, bias, group_rank(etp_group) == 0)
    return out
