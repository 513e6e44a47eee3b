"""The loss of a micro-batch whose sequence is split over the context-parallel group.

Each CP rank holds a share of the tokens, possibly with a different number of them masked, so
the mean of per-rank means is not the mean. The exact mean is ``sum / count`` with both reduced
over CP (legacy Megatron's rule); one all-reduce of two scalars per micro-batch. A rank whose
tokens are all masked contributes ``0 / count`` (no NaN: the count is the group's).

Gradients are averaged over the data-parallel x CP group (weights are replicated over CP), so
the gradient each rank back-propagates is ``CP x d(local sum) / count``: averaged over its CP
ranks it is the gradient of the exact mean. The value returned is the exact mean itself (equal
on every CP rank), which is what is logged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.distributed.collectives import Group, group_size


def exact_mean_loss(per_token: torch.Tensor, loss_mask: torch.Tensor | None,
                    group: Group) -> torch.Tensor:
    """Mean of ``per_token`` over the unmasked tokens of the whole (CP-split) micro-batch."""
    loss = per_token.float()
    mask = torch.ones_like(loss) if loss_mask is None else loss_mask.float()
    local = (loss * mask).sum()
    totals = torch.stack([local.detach(), mask.sum()])
    cp = group_size(group)
    if cp > 1:
        dist.all_reduce(totals, group=group)
    count = totals[1].clamp(min=1.0)
    scaled = local * (cp / count)
    return scaled + (totals[0] / count - scaled.detach())
