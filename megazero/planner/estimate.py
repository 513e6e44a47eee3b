"""One run's per-rank memory (itemised) and step time, from its validated config and a cluster.

Memory is computed for every pipeline stage (the first stage usually holds the most
activations, the last the logits) and the worst one is reported. Model states come from
:mod:`.model_states` (the engine's own layout); activations from :mod:`.activations`; the rest
are the engine's transient buffers, each stated below. Time is in :mod:`.step_time`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megazero.config import MegazeroConfig
from megazero.planner.activations import (
    embedding_logits_bytes,
    recompute_layer_bytes,
    segment_peak_bytes,
)
from megazero.planner.cluster import Cluster
from megazero.planner.model_states import model_state_report
from megazero.planner.shapes import meta_chunks, shape_topology

FRAGMENTATION = 0.05  # CUDA caching-allocator allowance on top of the tracked peak (not on CPU)


@dataclass
class RankMemory:
    pp_rank: int
    items: dict[str, float] = field(default_factory=dict)  # device bytes by item
    host: dict[str, float] = field(default_factory=dict)  # offloaded bytes by item
    numel: int = 0  # parameters held by this rank's chunks (full, before ZeRO sharding)

    @property
    def device_total(self) -> float:
        return sum(self.items.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


def _peak_activation_bytes(cfg: MegazeroConfig, pp_rank: int, m: int, flash: bool) -> float:
    """Walk this rank's schedule; each forward adds its chunk's saved bytes until its backward."""
    from megazero.pipeline.schedules import build_schedule

    p = cfg.parallel
    tp, pp, vpp = p.tp, p.pp, cfg.vpp or 1
    b = cfg.train.micro_batch_size
    layers = cfg.model.num_layers // (pp * vpp)
    chunk_bytes = []
    for c in range(vpp):
        v = c * pp + pp_rank  # virtual stage (round robin)
        chunk_bytes.append(recompute_layer_bytes(cfg, b, tp, layers, flash=flash)
                           + embedding_logits_bytes(cfg, b, tp, v == 0, v == pp * vpp - 1))
    live = peak = 0.0
    for step in build_schedule(pp, cfg.vpp, m, pp_rank,
                               group_size=p.microbatch_group_size_per_vp_stage):
        for a in step:
            if a.kind == "F":
                live += chunk_bytes[a.chunk]
                peak = max(peak, live)
            elif a.kind == "B":
                live -= chunk_bytes[a.chunk]
    return peak + segment_peak_bytes(cfg, b, tp, layers, flash)


def rank_memory(cfg: MegazeroConfig, pp_rank: int, num_microbatches: int, *,
                flash: bool = True, device_is_cpu: bool = False) -> RankMemory:
    p, z = cfg.parallel, cfg.zero
    layout = cfg.layout()
    dp = layout.dp
    chunks = meta_chunks(cfg, shape_topology(layout, pp_rank, 0, 0))
    sp = p.sequence_parallel and p.tp > 1
    rep = model_state_report(chunks, z, cfg.precision, dp=dp, tp=p.tp, pp=p.pp,
                             sequence_parallel=sp)
    out = RankMemory(pp_rank)
    out.numel = sum(q.numel() for c in chunks for q in c.parameters())
    for kind, name in (("params", "weights"), ("grads", "gradients"),
                       ("optimizer", "fp32 masters + Adam moments")):
        if rep.bytes[kind]["device"]:
            out.items[name] = rep.bytes[kind]["device"]
        if rep.bytes[kind]["offload"]:
            out.host[name] = rep.bytes[kind]["offload"]
    out.items["activations"] = _peak_activation_bytes(cfg, pp_rank, num_microbatches, flash)
    ps = cfg.precision.params_dtype.itemsize
    gs = ps
    if z.stage == 2:  # full-size staging buffers of the buckets being reduced (<= 2 with overlap)
        out.items["ZeRO buckets"] = min(out.numel, z.reduce_bucket_size) * gs * (
            2 if z.overlap_comm else 1)
    elif z.stage == 1:
        out.items["ZeRO buckets"] = min(out.numel, z.reduce_bucket_size) * gs / dp
    elif z.stage == 3:  # gathered units (live + prefetch) and one full gradient being reduced
        gathered = min(out.numel, z.stage3_max_live_parameters + z.stage3_prefetch_bucket_size)
        out.items["ZeRO gathered params + prefetch"] = gathered * ps + min(
            out.numel, z.reduce_bucket_size) * gs
    # the optimizer casts one sub-group of gradients to fp32 at a time (on the host if offloaded)
    shard = out.numel / (dp if z.stage else 1)
    if ps != 4 or z.offload_optimizer.enabled:
        temp = min(shard, z.sub_group_size) * 4
        (out.host if z.offload_optimizer.enabled else out.items)["fp32 grad sub-group"] = temp
    if p.pp > 1:  # receive buffers for one activation and one gradient
        m = cfg.model
        out.items["pipeline p2p buffers"] = 2 * ps * m.seq_length * cfg.train.micro_batch_size \
            * m.hidden_size / (p.tp if sp else 1)
    if not device_is_cpu:
        out.items["fragmentation allowance (5%)"] = FRAGMENTATION * out.device_total
    return out


@dataclass
class Estimate:
    config: MegazeroConfig
    cluster: Cluster
    ranks: list[RankMemory]
    time: Any  # StepTime

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.device_total)

    @property
    def fits(self) -> bool:
        w = self.worst
        return (w.device_total <= self.cluster.memory_bytes
                and w.host_total * self.cluster.gpus_per_node
                <= self.cluster.host_memory_gb * 1e9)

    def as_dict(self) -> dict[str, Any]:
        w = self.worst
        return {"cluster": self.cluster.name, "world_size": self.config.parallel.world_size,
                "worst_pp_rank": w.pp_rank, "device_bytes": w.items,
                "device_total": w.device_total, "host_bytes_per_rank": w.host,
                "per_stage_device_total": [r.device_total for r in self.ranks],
                "device_capacity": self.cluster.memory_bytes, "fits": self.fits,
                **self.time.as_dict()}


def estimate(cfg: MegazeroConfig, cluster: Cluster, num_microbatches: int | None = None,
             flash: bool | None = None, stages: list[int] | None = None) -> Estimate:
    """``stages``: the pipeline ranks to evaluate (default all; the layout search passes the
    first and last, which hold the most activations and the embedding / logits)."""
    from megazero.planner.step_time import step_time

    dp = cfg.layout().dp
    t = cfg.train
    gbs = t.global_batch_size or t.micro_batch_size * dp
    m = num_microbatches or max(1, gbs // (t.micro_batch_size * dp))
    cpu = cluster.name == "cpu"
    if flash is None:
        flash = not cpu and cfg.model.use_flash_attn
    ranks = [rank_memory(cfg, r, m, flash=flash, device_is_cpu=cpu)
             for r in (stages if stages is not None else range(cfg.parallel.pp))]
    units = 0
    if cfg.zero.stage == 3:
        from megazero.planner.model_states import _units

        chunks = meta_chunks(cfg, shape_topology(cfg.layout()))
        units = sum(len(_units(c, 1, 0, cfg.zero.stage3_param_persistence_threshold))
                    for c in chunks)
    return Estimate(cfg, cluster, ranks, step_time(cfg, cluster, m, ranks[0].numel, units))
