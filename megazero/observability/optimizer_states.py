"""Megatron-DeepSpeed's ``--log-optimizer-states-to-tensorboard``: norms and maxima of the Adam
moments and the fp32 weights over the whole model, written as ``optimizer/<state>_<norm>``.

Every element of the model counts once, whatever the layout: a rank sums the masters and
moments of the pieces it owns (:meth:`megazero.zero.master.MasterParams.stream_states`, offloaded
and NVMe-swapped states included), skipping the copies another rank also holds (a tensor every
TP rank keeps whole counts on TP rank 0, a tied embedding's second copy not at all; at ZeRO
stage 0 every data-parallel rank holds the same masters, so only the first of its group counts),
and one all-reduce of the sums (one of the maxima) over the world gives the model's numbers.
Collective: every rank calls it at the same iteration.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megazero.distributed.topology import ParallelTopology
from megazero.tensor_parallel.utils import is_duplicate_copy

#: the statistics, in the order of the summed vector (squared L2 norms, then L1 norms)
_SUMS = ("variance_l2", "variance_sqrt_l2", "momentum_l2", "weight_l2",
         "variance_l1", "variance_sqrt_l1", "momentum_l1", "weight_l1")
_MAXES = ("variance_abs_max", "variance_sqrt_abs_max", "momentum_abs_max", "weight_abs_max")


def _counted(param: Any, topo: ParallelTopology, stage: int) -> bool:
    """Whether this rank's piece of ``param`` is the copy that counts."""
    if is_duplicate_copy(param, topo.tp_rank):
        return False
    if stage > 0:  # the masters are sharded over the (expert-)data-parallel group
        return True
    return (topo.edp_rank if getattr(param, "expert", False) else topo.grad_rank) == 0


def optimizer_state_stats(engine: Any, topo: ParallelTopology) -> dict[str, float]:
    """``{"optimizer/variance_l2": ..., ...}`` over the whole model (see the module's doc);
    states the optimizer does not keep (SGD has no ``exp_avg_sq``) count as zeros."""
    sums = torch.zeros(len(_SUMS), dtype=torch.float64)
    maxes = torch.zeros(len(_MAXES), dtype=torch.float64)
    stage = engine.zero.stage

    def visit(piece: Any, states: dict[str, torch.Tensor | None]) -> None:
        if not _counted(piece.param, topo, stage):
            return
        v, m = states.get("exp_avg_sq"), states.get("exp_avg")
        parts = (v, None if v is None else v.sqrt(), m, states["master"])
        for i, t in enumerate(parts):
            if t is None or not t.numel():
                continue
            t = t.detach().double()
            sums[i] += t.square().sum().cpu()
            sums[4 + i] += t.abs().sum().cpu()
            maxes[i] = torch.maximum(maxes[i], t.abs().max().cpu())

    engine.masters.stream_states(visit)
    if dist.is_initialized() and topo.world_size > 1:
        both = torch.cat([sums, maxes]).to(engine.device)
        summed, peaked = both.clone(), both.clone()
        dist.all_reduce(summed)
        dist.all_reduce(peaked, op=dist.ReduceOp.MAX)
        sums, maxes = summed[:len(_SUMS)].cpu(), peaked[len(_SUMS):].cpu()
    out = {f"optimizer/{name}": float(sums[i].sqrt() if i < 4 else sums[i])
           for i, name in enumerate(_SUMS)}
    out.update({f"optimizer/{name}": float(maxes[i]) for i, name in enumerate(_MAXES)})
    return out
