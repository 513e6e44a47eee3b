"""What saving and loading a checkpoint share: each rank's directory name, the coordinate a
rank's ranges are filed under, the layout record, the configuration as JSON, and the default
collectives (which tests replace)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megazero.checkpoint.files import SAVE_IN_PROGRESS, remove_stale_tmp
from megazero.checkpoint.reader import TAG_TRACKER, TRACKER
from megazero.checkpoint.tensors import ParamInfo

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology
    from megazero.zero.optimizer import ZeroOptimizer


def pair_dir(tp: int, pp: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}"


def rank_dir(tp: int, pp: int, dp: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}_{dp:03d}"


def replica_coord(topo: ParallelTopology) -> Any:
    """This rank's coordinate with ``dp`` the index among the ranks holding the same weights
    (data replicas x context-parallel ranks: what ZeRO shards over). At cp = 1 the coordinate
    itself; with CP a checkpoint is laid out as if those ranks were data replicas, so it
    loads at any cp."""
    return topo.coord._replace(dp=topo.grad_rank)


def layout_of(topo: ParallelTopology, zero_stage: int) -> dict[str, Any]:
    return {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.grad_size,
            "vpp": topo.vpp_size or 1, "zero_stage": zero_stage}


def config_dict(config: Any) -> Any:
    """A dataclass config as plain JSON values (for config.json and experiment trackers)."""
    if is_dataclass(config):
        config = asdict(config)

    def value(o: Any) -> Any:  # a dataclass inside a plain dict (a model's MoE section)
        return asdict(o) if is_dataclass(o) and not isinstance(o, type) else str(o)

    return json.loads(json.dumps(config, default=value))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_all(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def is_engine(optimizer: Any) -> bool:
    from megazero.zero.optimizer import ZeroOptimizer

    return isinstance(optimizer, ZeroOptimizer)


def local_shapes(infos: list[ParamInfo], engine: ZeroOptimizer | None
                  ) -> dict[int, torch.Size]:
    """Each parameter's TP-shard shape (stage 3 releases ``.data`` to 0 elements)."""
    shapes = {id(i.param): i.param.shape for i in infos}
    if engine is not None:
        for store in engine.stores:
            shapes.update(store.param_shapes())
    return shapes


def remove_debris(root: str, directory: str) -> None:
    """Once a save is committed: its in-progress marker, and temporaries of earlier crashed
    saves in this iteration's directory and the tracker's."""
    try:
        os.remove(os.path.join(directory, SAVE_IN_PROGRESS))
    except FileNotFoundError:
        pass
    remove_stale_tmp(directory)
    for name in os.listdir(root):
        if name.startswith((TRACKER + ".tmp.", TAG_TRACKER + ".tmp.")):
            os.remove(os.path.join(root, name))
