"""Where expert gradients are reduced, and how they are scaled.

An expert's replicas are its expert-data-parallel (``edp``) group, not the data-parallel one:
with expert parallelism each rank holds ``E / EP`` experts and receives tokens from its
expert-parallel peers. Summing an expert's gradient over ``edp`` adds the contributions of
every token of the step; dividing by the size of the dense gradient group (as the dense
weights are averaged) makes it the gradient of the same mean loss the one-process run
minimises.

That group is ``dp`` x ``cp`` (:attr:`~megazero.topology.ParallelTopology.grad_group`): under
context parallelism each CP rank back-propagates ``CP`` times its share of the loss
(:mod:`megazero.context_parallel.loss`), so every token's gradient reaches its expert ``CP``
times too large and the sum over ``edp`` is divided by ``dp * cp``, not ``dp``.

When the ``edp`` groups are the dense gradient groups (``EP x ETP == TP``, all 1 included) the
experts share the dense flat buffers; otherwise they get their own buffers over ``edp`` and a
gradient hook pre-multiplies by ``edp / (dp * cp)`` (the buffer divides by its group's size,
``edp``).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.errors import ConfigError
from megazero.topology import ParallelTopology


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
    """``(dense, experts)``: experts empty when they can share the dense buffers."""
    experts = [p for p in params if is_expert(p)]
    if not experts or not experts_need_own_group(topo):
        return params, []
    if stage == 3:
        raise ConfigError(
            f"ZeRO stage 3 with --expert-model-parallel-size {topo.ep_size} and "
            f"--tensor-model-parallel-size {topo.tp_size}: stage 3 shards experts only when "
            "the two sizes are equal; set them equal or use zero stage 0-2")
    ids = {id(p) for p in experts}
    return [p for p in params if id(p) not in ids], experts


def scale_expert_grads(experts: list[nn.Parameter], topo: ParallelTopology) -> list[object]:
    """Multiply each expert gradient by ``edp / (dp * cp)`` as it is produced (see the module
    docstring); returns the hook handles."""
    factor = topo.edp_size / topo.grad_size
    if factor == 1.0:
        return []

    def hook(g: torch.Tensor) -> torch.Tensor:
        return g * factor

    return [p.register_hook(hook) for p in experts]  # type: ignore[no-untyped-call]
