"""Where expert gradients are reduced, and how they are scaled.

An expert's replicas are its expert-data-parallel (``edp``) group, not the data-parallel one:
with expert parallelism each rank holds ``E / EP`` experts and receives tokens from its
expert-parallel peers. Summing an expert's gradient over ``edp`` adds the contributions of
every token of the step; dividing by the size of the dense gradient group (as the dense
weights are averaged) makes it the gradient of the same mean loss the one-process run
minimises.

That group is ``dp`` x ``cp`` (:attr:`~megazero.distributed.topology.ParallelTopology.grad_group`):
under context parallelism each CP rank back-propagates ``CP`` times its share of the loss
(:mod:`megazero.context_parallel.loss`), so every token's gradient reaches its expert ``CP``
times too large and the sum over ``edp`` is divided by ``dp * cp``, not ``dp``.

When the ``edp`` groups are the dense gradient groups (``EP x ETP == TP``, all 1 included) the
experts share the dense flat buffers; otherwise they get their own buffers over ``edp`` and a
gradient hook pre-multiplies by ``edp / (dp * cp)`` (the buffer divides by its group's size,
``edp``).

At ZeRO stage 3 the experts stay in the stage-3 store of their model chunk, as units of their
own partitioned, gathered and reduce-scattered over ``edp`` (:mod:`megazero.zero.stage3`, as
DeepSpeed's ZeRO-3 partitions MoE experts); the store scales every gradient by
``1 / (dp * cp)`` before the sum, the same ``edp / (dp * cp)`` times an ``edp`` average.

Ordering (NCCL): the stage-3 collectives on the dense group and ``edp`` (expert units)
interleave, and every member of each group must issue that group's collectives in one order.
Every rank of a pipeline stage runs the same module graph: expert-parallel peers hold different
experts of identical shapes (an expert that received no token still runs on an empty batch and
produces its zero gradient), so every unit, bucket and padded size is the same on them; and
every decision that issues a collective (gather, prefetch depth, release, when a bucket is
complete, the persistent refresh: dense group first, then experts) reads only the recorded
execution order, the units' sizes and the config, never timing or data. So all ranks of a stage
issue one interleaved sequence, and each group's sequence is a subsequence of it.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.distributed.topology import ParallelTopology


def is_expert(param: nn.Parameter) -> bool:
    return bool(getattr(param, "expert", False))


def experts_need_own_group(topo: ParallelTopology) -> bool:
    """Whether this rank's ``edp`` group differs from its dense gradient group (``dp``, or
    ``dp_cp`` under context parallelism)."""
    if topo.ep_size == 1 and topo.tp_size == 1 and topo.etp_size == 1:
        return False
    return topo.ranks("edp") != topo.ranks("dp_cp" if topo.cp_size > 1 else "dp")


def split_expert_params(params: list[nn.Parameter], topo: ParallelTopology, stage: int
                        ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(dense, experts)`` at stages 0-2: experts empty when they can share the dense
    buffers. At stage 3 every parameter stays in the stage-3 store (``experts`` empty), which
    partitions expert units over ``edp`` (:func:`stage3_experts_own_group`)."""
    experts = [p for p in params if is_expert(p)]
    if not experts or not experts_need_own_group(topo) or stage == 3:
        return params, []
    ids = {id(p) for p in experts}
    return [p for p in params if id(p) not in ids], experts


def stage3_experts_own_group(params: list[nn.Parameter], topo: ParallelTopology) -> bool:
    """Whether ZeRO stage 3 partitions this chunk's expert units over ``topo.edp_group``
    rather than with the dense ones over dp (there are experts, and ``edp`` is not ``dp``)."""
    return any(is_expert(p) for p in params) and experts_need_own_group(topo)


def scale_expert_grads(experts: list[nn.Parameter], topo: ParallelTopology) -> list[object]:
    """Multiply each expert gradient by ``edp / (dp * cp)`` as it is produced (see the module
    docstring); returns the hook handles."""
    factor = topo.edp_size / topo.grad_size
    if factor == 1.0:
        return []

    def hook(g: torch.Tensor) -> torch.Tensor:
        return g * factor

    return [p.register_hook(hook) for p in experts]  # type: ignore[no-untyped-call]
