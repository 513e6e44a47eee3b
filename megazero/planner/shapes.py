"""This rank's model chunks with real shapes and no storage: the planner's view of the model.

The chunks are built by the same :func:`~megazero.pipeline.partition.build_model_chunks` the
training run calls, on the ``meta`` device, with a topology that has the layout's sizes and this
rank's coordinates but no process groups. Parameter shapes, the flags the ZeRO engine reads
(``sequence_parallel``, ``shared_embedding``) and the module tree are therefore the run's own,
even for a 175B model on a laptop. The tensor-parallel group is a stand-in that answers only
its size and this rank's place in it (all that layer construction asks); weight initialisation
is skipped, since values do not change byte counts.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist

from megazero.config import MegazeroConfig
from megazero.config.layout import GROUP_KINDS, ParallelLayout
from megazero.config.rules import sequence_parallel_active
from megazero.distributed.topology import ParallelTopology


class ShapeGroup:
    """Stands in for a process group during shape-only construction: a size and a rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


def shape_topology(layout: ParallelLayout, pp_rank: int = 0, dp_rank: int = 0,
                   tp_rank: int = 0) -> ParallelTopology:
    """A topology with ``layout``'s sizes and the rank at the given coordinates; its TP group
    (and with context parallelism its CP and TP x CP groups, which an MoE router sums over) are
    :class:`ShapeGroup` stand-ins (the others are absent)."""
    from megazero.config.layout import TP_CP_GROUP_KIND

    groups: dict = {k: None for k in GROUP_KINDS}
    if layout.tp > 1:
        groups["tp"] = ShapeGroup(layout.tp, tp_rank)
    if layout.cp > 1:
        groups["cp"] = ShapeGroup(layout.cp, 0)
        if layout.tp > 1:
            groups[TP_CP_GROUP_KIND] = ShapeGroup(layout.tp * layout.cp, tp_rank)
    return ParallelTopology(layout, layout.rank(pp_rank, dp_rank, tp_rank), groups)


@contextmanager
def shape_only():
    """Inside, layers build with :class:`ShapeGroup` stand-ins and without initialising their
    weights (values do not change byte counts)."""
    real_size, real_rank = dist.get_world_size, dist.get_rank

    def size(group=None):
        return group.size if isinstance(group, ShapeGroup) else real_size(group)

    def rank(group=None):
        return group.rank if isinstance(group, ShapeGroup) else real_rank(group)

    with mock.patch("megazero.model.gpt.initialize_parameters", lambda *a, **k: None), \
            mock.patch.object(dist, "get_world_size", size), \
            mock.patch.object(dist, "get_rank", rank):
        yield


_CACHE: dict = {}


def meta_chunks(cfg: MegazeroConfig, topo: ParallelTopology) -> list[torch.nn.Module]:
    """This rank's model chunks on the meta device, in the training dtype (cached: the layout
    search asks for the same shapes many times; nothing here mutates them)."""
    key = (cfg.model, topo.tp_size, topo.pp_size, topo.pp_rank, topo.tp_rank,
           cfg.parallel.num_layers_per_virtual_pipeline_stage,
           cfg.parallel.pipeline_schedule, cfg.parallel.pipeline_model_parallel_layout,
           cfg.parallel.decoder_first_pipeline_num_layers,
           cfg.parallel.decoder_last_pipeline_num_layers,
           cfg.parallel.account_for_embedding_in_pipeline_split,
           cfg.parallel.account_for_loss_in_pipeline_split,
           sequence_parallel_active(cfg.parallel.sequence_parallel, topo.tp_size),
           cfg.precision.params_dtype, topo.ep_size, topo.ep_rank,  # MoE: this rank's experts
           topo.etp_size, topo.etp_rank)  # and its slice of each
    if key not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = _build(cfg, topo)
    return _CACHE[key]


def _build(cfg: MegazeroConfig, topo: ParallelTopology) -> list[torch.nn.Module]:
    from megazero.config.schema import layer_counts
    from megazero.pipeline.partition import build_model_chunks
    from megazero.pipeline.zero_bubble import placement_of
    from megazero.tensor_parallel.context import ParallelContext

    with torch.device("meta"), shape_only():  # shape-only groups answer size and rank here
        parallel = ParallelContext.from_topology(
            topo, sequence_parallel=cfg.parallel.sequence_parallel)
        chunks = build_model_chunks(cfg.model, topo,
                                    cfg.parallel.num_layers_per_virtual_pipeline_stage,
                                    parallel=parallel, seed=cfg.train.seed,
                                    placement=placement_of(cfg.parallel.pipeline_schedule),
                                    layer_counts=layer_counts(cfg))
    dtype = cfg.precision.params_dtype
    for c in chunks:
        for p in c.parameters():
            p.data = p.data.to(dtype)
    return chunks
