"""Writing a checkpoint's tensors into this rank's parameters, ZeRO shards and optimizer state,
one tensor range at a time.

Loading must not build the model on any rank. Each tensor is read from the files' mmap pages
straight into the storage that keeps it: a parameter, or at ZeRO stage 3 the rank's partition of
its unit (never the gathered parameters; with NVMe parameter offload, one unit's shard on the
host, then written to its swap file), and the masters and Adam moments only for the ranges
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

from megazero.checkpoint.shard_reader import ShardReader
from megazero.checkpoint.tensors import ParamInfo


def _stage3_units(engine: Any) -> list[Any]:
    """Every ZeRO stage-3 unit (a module's flattened parameters) of this rank, else none."""
    if engine is None or engine.zero.stage != 3:
        return []
    return [u for store in engine.stores for u in getattr(store, "units", [])]


@torch.no_grad()
def load_weights(reader: ShardReader, infos: list[ParamInfo], shapes: dict[int, torch.Size],
                 engine: Any, tp_rank: int, tp_size: int) -> None:
    """Every parameter's weights from the checkpoint; the fp32 masters follow them."""
    by_param = {id(i.param): i for i in infos}

    def whole(i: ParamInfo) -> None:
        reader.local(i.name, "weight", i, tuple(shapes[id(i.param)]), tp_rank, tp_size,
                     into=i.param.data)

    done: set[int] = set()
    for u in _stage3_units(engine):
        mine = [(by_param[id(p)], s) for p, s in zip(u.params, u.starts) if id(p) in by_param]
        done.update(id(i.param) for i, _ in mine)
        if u.full is not None:  # gathered (or persistent: its shard is a view of ``full``)
            for i, _ in mine:
                whole(i)
            if u.persistent:
                continue
        # NVMe parameter offload: the shard lives in a swap file; fill a host copy, write it
        shard = (torch.zeros(u.shard_size, dtype=u.shard.dtype) if u.swap is not None
                 else u.shard)
        for i, start in mine:
            n = math.prod(shapes[id(i.param)])
            lo, hi = max(start, u.own_lo), min(start + n, u.own_hi)
            if lo < hi:  # the part of this parameter in the rank's partition of the unit
                reader.flat(i.name, "weight", i, tuple(shapes[id(i.param)]), tp_rank, tp_size,
                            lo - start, hi - start, into=shard[lo - u.own_lo:hi - u.own_lo])
        if u.swap is not None:
            u.swap.swapper.write_shard(u.swap.slot, shard)
    for i in infos:
        if id(i.param) not in done:  # not sharded: the parameter holds its whole TP shard
            whole(i)
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
