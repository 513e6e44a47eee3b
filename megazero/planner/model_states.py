"""Model-state bytes per rank, laid out exactly as the ZeRO engine lays them out.

The engine (:mod:`megazero.zero.buffers`, :mod:`megazero.zero.stage3`,
:mod:`megazero.zero.master`) allocates flat buffers whose sizes depend on bucket boundaries,
padding to a multiple of dp, which parameters are deferred (sequence-parallel and tied-embedding
gradients have buckets of their own), stage-3 units per module, persistence thresholds, the
sub-group split of the masters and the optimizer's state (AdamW: two moments and one ``step``
tensor per master piece). This module
replays that arithmetic on the parameter shapes of :func:`megazero.planner.shapes.meta_chunks`
and fills the same :class:`~megazero.zero.accounting.MemoryReport` the engine's
``memory_report()`` fills from real storage, so the two are compared byte for byte in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.planner.onebit_states import onebit_state_bytes
from megazero.zero.accounting import MemoryReport
from megazero.zero.units import unit_is_expert, unit_param_groups

STEP_BYTES = 4  # torch Adam/AdamW keep a float32 scalar ``step`` tensor per parameter


@dataclass
class _Piece:
    numel: int
    ndim: int


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _deferred(p: nn.Parameter, tp: int, pp: int, sp: bool) -> str | None:
    if sequence_parallel_active(sp, tp) and getattr(p, "sequence_parallel", False):
        return "sp"
    if tp > 1 and getattr(p, "tp_partial_grad", False):  # q/k norms (zero.build.deferred_kinds)
        return "sp"
    if pp > 1 and getattr(p, "shared_embedding", False):
        return "emb"
    return None


def _buffer(params: list[nn.Parameter], stage: int, dp: int, dp_rank: int, bucket_numel: int,
            tp: int, pp: int, sp: bool) -> tuple[int, int, int, list[_Piece]]:
    """GradBuffer: (padded numel, stage-2 shard numel, padding, owned pieces)."""
    groups: dict[str | None, list[nn.Parameter]] = {None: [], "sp": [], "emb": []}
    for p in reversed(params):
        groups[_deferred(p, tp, pp, sp)].append(p)
    total = shard_total = padding = 0
    pieces: list[_Piece] = []
    for plist in groups.values():
        slots: list[tuple[nn.Parameter, int]] = []
        size = 0
        for i, p in enumerate(plist):
            slots.append((p, size))
            size += p.numel()
            if size >= bucket_numel or i == len(plist) - 1:
                padded = -(-size // dp) * dp
                shard = padded // dp
                own_lo, own_hi = (0, padded) if stage == 0 else (dp_rank * shard,
                                                                 (dp_rank + 1) * shard)
                for q, start in slots:
                    lo, hi = max(start, own_lo), min(start + q.numel(), own_hi)
                    if lo < hi:
                        pieces.append(_Piece(hi - lo, q.ndim))
                total += padded
                shard_total += shard
                padding += padded - size
                slots, size = [], 0
    return total, shard_total, padding, pieces


def _units(chunk: nn.Module, dp: int, dp_rank: int, threshold: int,
           edp: int | None = None, edp_rank: int = 0
           ) -> list[tuple[int, int, bool, list[_Piece]]]:
    """Stage3Params: per unit (padded numel, numel, persistent, owned pieces). ``edp``: MoE
    expert units are partitioned over an expert-data-parallel group of that size."""
    out = []
    dense = (dp, dp_rank)

    def add(params: list[nn.Parameter]) -> None:
        dp, dp_rank = (edp, edp_rank) if edp and unit_is_expert(params) else dense
        n = sum(p.numel() for p in params)
        padded = -(-n // dp) * dp
        shard = padded // dp
        own_lo, own_hi = dp_rank * shard, (dp_rank + 1) * shard
        pieces, start = [], 0
        for p in params:
            lo, hi = max(start, own_lo), min(start + p.numel(), own_hi)
            if lo < hi:
                pieces.append(_Piece(hi - lo, p.ndim))
            start += p.numel()
        out.append((padded, n, n < threshold, pieces))

    for params, _ in unit_param_groups(chunk):
        add(params)
    return out


def model_state_report(chunks: list[nn.Module], zero: ZeroConfig, precision: PrecisionConfig,
                       *, dp: int, dp_rank: int = 0, tp: int = 1, pp: int = 1,
                       sequence_parallel: bool = False,
                       optimizer: OptimizerConfig | None = None,
                       edp: int | None = None, edp_rank: int = 0,
                       extras: dict[str, int] | None = None) -> MemoryReport:
    """The bytes ``engine.memory_report()`` reports after an optimizer step on this rank, for
    the optimizer ``optimizer`` names (default: AdamW). ``edp``: MoE experts have flat buffers
    of their own over the expert-data-parallel group of that size (stages 0-2; at stage 3 their
    units are partitioned over it; pass it only when that group is not the dp group,
    :func:`megazero.moe.grads.experts_need_own_group`).
    ``extras``: filled with the 1-bit optimizers' state beyond the moments, by term
    (:mod:`megazero.planner.onebit_states`; already in the ``optimizer`` bytes)."""
    from megazero.zero.offload import OffloadPlan
    from megazero.zero.optimizers import state_layout

    moments, has_step = state_layout(optimizer or OptimizerConfig())

    dtype = precision.params_dtype
    grad_dtype = precision.grad_dtype  # fp32 for bf16 by default, as the engine
    ps, gs = _size(dtype), _size(grad_dtype)
    report = MemoryReport(device_type="cpu")
    b = report.bytes
    plan = OffloadPlan.from_config(zero)
    pieces: list[_Piece] = []
    for chunk in chunks:
        params = [p for p in chunk.parameters() if p.requires_grad]
        if not params:
            continue
        if zero.stage < 3:
            experts = [p for p in params if getattr(p, "expert", False)] if edp else []
            dense = [p for p in params if not getattr(p, "expert", False)] if edp else params
            for group, size, rank in ((experts, edp or 1, edp_rank), (dense, dp, dp_rank)):
                if not group:
                    continue
                total, shard_total, padding, own = _buffer(
                    group, zero.stage, size, rank, max(1, int(zero.reduce_bucket_size)), tp, pp,
                    sequence_parallel)
                b["params"]["device"] += total * ps
                b["grads"]["device"] += (total if zero.stage < 2 else shard_total) * gs
                report.padding_elements += padding
                pieces += own
        else:
            group = [edp if edp and unit_is_expert(ps) else dp
                     for ps, _ in unit_param_groups(chunk)]  # each unit's partition group
            for (padded, numel, persistent, own), size in zip(_units(
                    chunk, dp, dp_rank, zero.stage3_param_persistence_threshold, edp, edp_rank),
                    group, strict=True):
                shard = padded // size
                if persistent:
                    b["params"]["device"] += padded * ps
                else:
                    b["params"]["offload" if plan.params else "device"] += shard * ps
                b["grads"]["device"] += shard * gs
                report.padding_elements += padded - numel
                pieces += own
    # MasterParams: pieces split at sub_group_size; fp32 masters are copies unless the run is
    # fp32 and not offloaded (then the master is the parameter itself).
    limit = max(1, int(zero.sub_group_size))
    split = [min(limit, p.numel - lo) for p in pieces if p.numel for lo in range(0, p.numel, limit)]
    copy = plan.optimizer or dtype != torch.float32
    place = "offload" if plan.optimizer else "device"
    n = sum(split)
    b["optimizer"][place] += ((4 * n if copy else 0) + moments * 4 * n
                              + (STEP_BYTES * len(split) if has_step else 0))
    onebit = onebit_state_bytes(optimizer, split, dp)  # error feedback and the like
    b["optimizer"][place] += sum(onebit.values())
    if extras is not None:
        extras.update(onebit)
    return report
