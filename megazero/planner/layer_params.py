"""Parameters a rank holds, from one layer at a time: what the layout search needs to time
thousands of layouts without building each layout's whole model.

A rank's count is its chunks' layers plus, on the first and last virtual stage, the embedding
and the final norm and output layer. Each piece is built once on the meta device
(:mod:`megazero.planner.shapes`: the training run's own modules, shapes only) and its count
cached by what decides it: a layer's by (tensor, expert and expert-tensor parallel sizes,
sequence parallelism, dense or MoE), the ends by their role. The layouts of one search then
share a few dozen small builds instead of one full build each; the memory estimate of the few
layouts worth it still builds the whole chunks (:func:`megazero.planner.estimate.rank_memory`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from megazero.config import MegazeroConfig, ModelConfig
from megazero.config.layout import ParallelLayout
from megazero.config.rules import sequence_parallel_active
from megazero.pipeline.partition import chunk_layer_ranges, chunk_roles
from megazero.planner.shapes import shape_only, shape_topology


@lru_cache(maxsize=4096)
def _chunk_numel(model: ModelConfig, tp: int, sp: bool, ep: int, etp: int, layer: int,
                 layers: int, pre: bool, post: bool) -> int:
    """Parameters of a chunk of ``layers`` layers from ``layer`` with the given ends, on the
    rank at coordinates 0 of a layout with these sizes (every rank of a layout holds as many:
    experts and slices are even)."""
    import torch

    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel.context import ParallelContext

    world = tp * ep * etp  # a grid that holds tp and etp x ep; pp and the rest do not matter
    topo = shape_topology(ParallelLayout(world, tp, 1, None, 1, ep=ep, etp=etp))
    with torch.device("meta"), shape_only():
        parallel = ParallelContext.from_topology(topo, sequence_parallel=sp)
        chunk = GPTModel(model, topo, parallel=parallel, layer_range=(layer, layer + layers),
                         pre_process=pre, post_process=post)
    return sum(p.numel() for p in chunk.parameters())


def _is_moe(model: ModelConfig, layer: int) -> bool:
    return model.moe.num_experts is not None and model.moe.is_moe_layer(layer, model.num_layers)


@lru_cache(maxsize=64)
def _first_of_kind(model: ModelConfig, moe: bool) -> int:
    return next(i for i in range(model.num_layers) if _is_moe(model, i) == moe)


def _layer_numel(model: ModelConfig, tp: int, sp: bool, ep: int, etp: int, layer: int) -> int:
    """One layer's parameters: those of its MoE or dense kind (the same for every layer of a
    kind), counted on a chunk without ends (built with learned positions: RoPE holds no
    parameters, and its tables are the slow part of a build on the meta device)."""
    twin = _first_of_kind(model, _is_moe(model, layer))
    plain = replace(model, position_embedding_type="learned_absolute")
    return _chunk_numel(plain, tp, sp, ep, etp, twin, 1, False, False)


def stage_numel(cfg: MegazeroConfig, pp_rank: int) -> int:
    """Parameters held by pipeline rank ``pp_rank``'s chunks (full, before ZeRO sharding):
    what ``sum(p.numel() for chunk in meta_chunks(cfg, ...) for p in chunk.parameters())``
    gives, from cached pieces."""
    from megazero.config.schema import layer_counts
    from megazero.pipeline.zero_bubble import placement_of

    p = cfg.parallel
    counts = layer_counts(cfg)
    return _stage_numel(cfg.model, p.tp, sequence_parallel_active(p.sequence_parallel, p.tp),
                        p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.pp,
                        p.num_layers_per_virtual_pipeline_stage, pp_rank,
                        placement_of(p.pipeline_schedule), None if counts is None else
                        tuple(counts))


@lru_cache(maxsize=8192)
def _stage_numel(m: ModelConfig, tp: int, sp: bool, ep: int, etp: int, pp: int, vl: int | None,
                 pp_rank: int, placement: str = "loop",
                 counts: tuple[int, ...] | None = None) -> int:
    """Each stage is charged its own layers, embedding and loss (uneven splits, the V)."""
    ranges = chunk_layer_ranges(m.num_layers, pp, vl, placement,
                                None if counts is None else list(counts))
    total = 0
    roles = chunk_roles(pp_rank, pp, len(ranges[0]), placement)
    for (lo, hi), (pre, post) in zip(ranges[pp_rank], roles):
        layers = sum(_layer_numel(m, tp, sp, ep, etp, i) for i in range(lo, hi))
        ends = 0
        if pre or post:  # the embedding / final norm and head, beside one layer
            at = min(lo, m.num_layers - 1)  # a stage may hold no layer (uneven splits)
            ends = _chunk_numel(m, tp, sp, ep, etp, at, 1, pre, post) - _chunk_numel(
                m, tp, sp, ep, etp, at, 1, False, False)
        total += layers + ends
    return total
