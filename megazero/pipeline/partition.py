"""Split the transformer layers over pipeline stages and virtual chunks.

Without interleaving, stage ``p`` of ``pp`` holds the contiguous layers
``[p * L / pp, (p + 1) * L / pp)``. With ``--num-layers-per-virtual-pipeline-stage n`` the
model is cut into ``L / n`` virtual stages of ``n`` layers, dealt round-robin (Megatron's
order): model chunk ``c`` of stage ``p`` is virtual stage ``c * pp + p``, so each stage holds
``vpp = L / (pp * n)`` chunks. The embedding lives on virtual stage 0 (stage 0, chunk 0); the
final norm, output head and loss on the last one (stage ``pp - 1``, chunk ``vpp - 1``).

The V placement of ZBV and DualPipeV (``placement="v"``) cuts the model into ``2 pp`` virtual
stages of ``L / (2 pp)`` layers; rank ``p`` holds stage ``p`` as chunk 0 and stage
``2 pp - 1 - p`` as chunk 1, so rank 0 holds the embedding and the head with the loss.
"""

from __future__ import annotations

from typing import Any

from megazero.config import ConfigError, ModelConfig, RecomputeConfig
from megazero.config.rules import pipeline_chunks
from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.schedules import stage_owner, virtual_stage
from megazero.tensor_parallel.context import ParallelContext

LayerRange = tuple[int, int]




def chunk_layer_ranges(
    num_layers: int, pp: int, layers_per_virtual_stage: int | None = None,
    placement: str = "loop", layer_counts: list[int] | None = None,
) -> list[list[LayerRange]]:
    """Global layer ranges ``[start, end)`` indexed ``[pp_rank][chunk]``."""
    if layer_counts is not None:
        return ranges_from_counts(layer_counts, pp, placement)
    if placement == "v":
        n = v_layers_per_chunk(num_layers, pp)
        return [[(v * n, (v + 1) * n) for v in (p, 2 * pp - 1 - p)] for p in range(pp)]
    vpp = pipeline_chunks(num_layers, pp, layers_per_virtual_stage)
    per_stage = num_layers // pp
    if layers_per_virtual_stage is None:
        return [[(p * per_stage, (p + 1) * per_stage)] for p in range(pp)]
    n = layers_per_virtual_stage
    return [[((c * pp + p) * n, (c * pp + p + 1) * n) for c in range(vpp)] for p in range(pp)]


def ranges_from_counts(counts: list[int], pp: int, placement: str = "loop"
                       ) -> list[list[LayerRange]]:
    """Layer ranges ``[pp_rank][chunk]`` from the layers of each virtual stage in stage order
    (an uneven split, :func:`megazero.config.rules.stage_layer_counts`); a stage may hold
    none (the embedding or the loss alone)."""
    vpp = len(counts) // pp
    out: list[list[LayerRange]] = [[(0, 0)] * vpp for _ in range(pp)]
    start = 0
    for v, n in enumerate(counts):
        rank, chunk = stage_owner(v, pp, placement)
        out[rank][chunk] = (start, start + n)
        start += n
    return out


def v_layers_per_chunk(num_layers: int, pp: int) -> int:
    """Layers per chunk of the V (two chunks per rank); refuses a count it cannot split."""
    if pp < 2 or num_layers % (2 * pp):
        raise ConfigError(
            f"--pipeline-schedule zbv/dualpipev puts 2 x {pp} = {2 * pp} equal chunks in a V "
            f"but --num-layers {num_layers} is not a multiple of {2 * pp}; use "
            f"{max(2 * pp, num_layers // (2 * pp) * 2 * pp)} layers, or another schedule")
    return num_layers // (2 * pp)


def chunk_roles(pp_rank: int, pp: int, vpp: int, placement: str = "loop"
                ) -> list[tuple[bool, bool]]:
    """``(pre_process, post_process)`` per chunk of ``pp_rank``: embedding / head + loss."""
    last = pp * vpp - 1
    stages = [virtual_stage(pp_rank, c, pp, placement) for c in range(vpp)]
    return [(v == 0, v == last) for v in stages]


def build_model_chunks(
    model_config: ModelConfig,
    topo: ParallelTopology,
    layers_per_virtual_stage: int | None = None,
    *,
    parallel: ParallelContext | None = None,
    recompute: RecomputeConfig | None = None,
    model_cls: Any = None,
    placement: str = "loop",
    layer_counts: list[int] | None = None,
    **model_kwargs: Any,
) -> list[Any]:
    """This rank's model chunks, in chunk order, each a ``GPTModel`` over its layer range.

    ``parallel``, ``recompute`` and ``model_kwargs`` (``seed``...) go to every chunk
    unchanged; a context without an RNG tracker lets each chunk make its own. Because weights
    are initialised from global layer indices, chunk ``[4, 8)`` has the weights of layers 4-7
    of the full model built with the same seed.
    """
    if model_cls is None:
        from megazero.model.gpt import GPTModel

        model_cls = GPTModel
    ranges = chunk_layer_ranges(model_config.num_layers, topo.pp_size, layers_per_virtual_stage,
                                placement, layer_counts)
    vpp = len(ranges[0])
    if (topo.vpp_size or 1) != vpp:
        raise ConfigError(
            f"the topology has vpp={topo.vpp_size} model chunks per stage but --num-layers "
            f"{model_config.num_layers}, pp {topo.pp_size} and "
            f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} give {vpp}; "
            f"build the topology with vpp={vpp if vpp > 1 else None}")
    roles = chunk_roles(topo.pp_rank, topo.pp_size, vpp, placement)
    return [
        model_cls(model_config, topo, parallel=parallel, recompute=recompute, layer_range=rng,
                  pre_process=pre, post_process=post, **model_kwargs)
        for rng, (pre, post) in zip(ranges[topo.pp_rank], roles)
    ]
