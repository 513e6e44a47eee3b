"""Writing a checkpoint's tensors into this rank's parameters, ZeRO shards and optimizer state,
one tensor range at a time.

Loading must not build the model on any rank. Each tensor is read from the files' mmap pages
straight into the storage that keeps it: a parameter, or at ZeRO stage 3 the rank's partition of
its unit (never the gathered parameters), and the masters and Adam moments only for the ranges
this rank's optimizer pieces own. Values go from the file's pages into the destination
(``read_slice(into=...)``); the only temporaries are the partial first and last rows of a flat
range and, where a tensor's split dim changed, one global tensor. So a rank's memory rises by
the Adam moments it creates and little else (see bench/checkpoint_load_memory.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megazero.checkpoint.reader import ShardReader
from megazero.checkpoint.tensors import ParamInfo


def _stage3_units(engine: Any) -> dict[int, tuple[Any, int]]:
    """``id(param) -> (unit, first element of the param in the unit)`` at ZeRO stage 3."""
    out: dict[int, tuple[Any, int]] = {}
    if engine is None or engine.zero.stage != 3:
        return out
    for store in engine.stores:
        for u in getattr(store, "units", []):
            for p, s in zip(u.params, u.starts):
                out[id(p)] = (u, s)
    return out


@torch.no_grad()
def load_weights(reader: ShardReader, infos: list[ParamInfo], shapes: dict[int, torch.Size],
                 engine: Any, tp_rank: int, tp_size: int) -> None:
    """Every parameter's weights from the checkpoint; the fp32 masters follow them."""
    units = _stage3_units(engine)

    def whole(i: ParamInfo) -> None:
        reader.local(i.name, "weight", i, tuple(shapes[id(i.param)]), tp_rank, tp_size,
                     into=i.param.data)

    if any(u.swap is not None for u, _ in units.values()):
        # NVMe parameter offload: the shards live in swap files, written back on release
        with engine.gathered_parameters(write_back=True):
            for i in infos:
                whole(i)
        return
    for i in infos:
        where = units.get(id(i.param))
        if where is None:  # not sharded: the parameter holds its whole TP shard
            whole(i)
            continue
        u, start = where
        if u.full is not None:  # gathered (or persistent: its shard is a view of ``full``)
            whole(i)
            if u.persistent:
                continue
        n = math.prod(shapes[id(i.param)])
        lo, hi = max(start, u.own_lo), min(start + n, u.own_hi)
        if lo < hi:  # the part of this parameter in the rank's partition of the unit
            reader.flat(i.name, "weight", i, tuple(shapes[id(i.param)]), tp_rank, tp_size,
                        lo - start, hi - start, into=u.shard[lo - u.own_lo:hi - u.own_lo])
    if engine is not None:
        engine.sync_masters_from_model()


def load_optimizer_states(reader: ShardReader, infos: list[ParamInfo],
                          shapes: dict[int, torch.Size], engine: Any, tp_rank: int,
                          tp_size: int) -> None:
    """fp32 masters, Adam moments and step for the ranges this rank's optimizer owns."""
    by_param = {id(i.param): i for i in infos}

    def read(param: nn.Parameter, kind: str, lo: int, dest: torch.Tensor) -> None:
        i = by_param[id(param)]
        reader.flat(i.name, kind, i, tuple(shapes[id(param)]), tp_rank, tp_size, lo,
                    lo + dest.numel(), into=dest)

    def step(param: nn.Parameter) -> torch.Tensor:
        return reader.full(by_param[id(param)].name, "step")

    engine.load_param_states(read, step)
