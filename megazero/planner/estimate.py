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
    chunk_saved_bytes,
    core_attention_saves_scores,
    loss_transient_bytes,
    peak_saved_bytes,
    segment_peak_bytes,
    uses_sdpa_math,
)
from megazero.planner.cluster import Cluster
from megazero.planner.model_states import model_state_report
from megazero.planner.onebit_states import ONEBIT_ITEMS
from megazero.planner.shapes import meta_chunks, shape_topology

FRAGMENTATION = 0.05  # CUDA caching-allocator allowance on top of the tracked peak (not on CPU)


#: fp32 gradient copies on host masters go through one buffer kept between steps
#: (megazero.zero.master.MasterParams._staged): live throughout, like the model states
GRAD_STAGING_ITEM = "fp32 grad staging buffer (host)"
#: --async-save: each rank's parameters and optimizer state copied to the host at a save
#: (megazero.checkpoint.async_save), the same bytes the run's own check refuses to launch without
ASYNC_STAGING_ITEM = "async save staging (host)"
STATE_ITEMS = ("weights", "gradients", "fp32 masters + Adam moments", GRAD_STAGING_ITEM,
               *ONEBIT_ITEMS)
FRAGMENTATION_ITEM = "fragmentation allowance (5%)"
#: --fp8-format: the FP8 copies of the largest GEMM's input and weight (megazero.planner.fp8_cost)
FP8_CAST_ITEM = "FP8 cast buffers"


@dataclass
class RankMemory:
    """Device bytes in two phases that do not overlap: ``items`` holds the model states (live
    throughout) and what lives during forward and backward (activations, ZeRO buckets and
    gathered parameters, pipeline receive buffers); ``sync`` what lives while the last
    micro-batch's backward reduces the gradients (one micro-batch's activations, the ZeRO
    buckets' staging copies, gradients still in autograd's tensors); ``step`` what lives only
    during the optimizer step (fp32 gradient copies, the optimizer's own temporaries). The peak
    is the model states plus the largest of the three phases."""

    pp_rank: int
    items: dict[str, float] = field(default_factory=dict)  # device bytes by item
    host: dict[str, float] = field(default_factory=dict)  # offloaded bytes by item
    sync: dict[str, float] = field(default_factory=dict)  # device bytes in the last backward
    step: dict[str, float] = field(default_factory=dict)  # device bytes during the step
    numel: int = 0  # parameters held by this rank's chunks (full, before ZeRO sharding)

    @property
    def states_total(self) -> float:
        return sum(v for k, v in self.items.items() if k in STATE_ITEMS)

    @property
    def backward_total(self) -> float:
        return sum(v for k, v in self.items.items()
                   if k not in STATE_ITEMS and k != FRAGMENTATION_ITEM)

    @property
    def step_total(self) -> float:
        return sum(self.step.values())

    @property
    def device_total(self) -> float:
        return self.states_total + max(self.backward_total, sum(self.sync.values()),
                                       self.step_total) + self.items.get(FRAGMENTATION_ITEM, 0.0)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


def _peak_activation_bytes(cfg: MegazeroConfig, pp_rank: int, m: int, flash: bool,
                           sdpa_math: bool = False) -> float:
    """Saved bytes at the schedule's peak plus one full-recompute segment rematerialised."""
    b, tp = cfg.train.micro_batch_size, cfg.parallel.tp
    layers = cfg.model.num_layers // (cfg.parallel.pp * (cfg.vpp or 1))
    return peak_saved_bytes(cfg, pp_rank, m, flash=flash, sdpa_math=sdpa_math) + \
        segment_peak_bytes(cfg, b, tp, layers, flash, sdpa_math)


@dataclass
class Zero3Layout:
    """One model chunk under stage 3: units gathered (not persistent), the largest unit and
    the gradient buckets' padded sizes (the engine's own rule: plan_grad_buckets)."""

    gathered: int
    largest_unit: int
    buckets: list[int]


def zero3_layout(cfg: MegazeroConfig, chunk: Any, topo: Any, dp: int,
                 edp: int | None = None) -> Zero3Layout:
    """``edp``: MoE expert units are partitioned over an expert-data-parallel group of that
    size (and never share a gradient bucket with dense units); None where it is dp."""
    from megazero.planner.model_states import _units
    from megazero.zero.build import deferred_kinds
    from megazero.zero.stage3_grads import plan_grad_buckets
    from megazero.zero.units import unit_is_expert, unit_param_groups

    units = _units(chunk, dp, 0, cfg.zero.stage3_param_persistence_threshold, edp)
    groups = [ps for ps, _ in unit_param_groups(chunk)]  # the same units, in the same order
    kinds = deferred_kinds([p for ps in groups for p in ps], topo,
                           cfg.parallel.sequence_parallel)
    sizes = [padded for padded, *_ in units]
    plan = plan_grad_buckets(sizes, [any(id(p) in kinds for p in ps) for ps in groups],
                             max(1, int(cfg.zero.reduce_bucket_size)),
                             [int(bool(edp) and unit_is_expert(ps)) for ps in groups])
    return Zero3Layout(gathered=sum(not persistent for _, _, persistent, _ in units),
                       largest_unit=max(sizes, default=0),
                       buckets=[sum(sizes[i] for i in idx) for idx in plan])


def rank_memory(cfg: MegazeroConfig, pp_rank: int, num_microbatches: int, *,
                flash: bool = True, device_is_cpu: bool = False) -> RankMemory:
    p, z = cfg.parallel, cfg.zero
    layout = cfg.layout()
    dp = layout.dp * layout.cp  # the ranks ZeRO shards over: data replicas x context parallel
    chunks = meta_chunks(cfg, shape_topology(layout, pp_rank, 0, 0))
    sp = p.sequence_parallel_active
    rep = model_state_report(chunks, z, cfg.precision, dp=dp, tp=p.tp, pp=p.pp,
                             sequence_parallel=sp, optimizer=cfg.optimizer,
                             edp=layout.edp if layout.ep != layout.tp else None,
                             extras=(onebit := {}))
    out = RankMemory(pp_rank)
    out.numel = sum(q.numel() for c in chunks for q in c.parameters())
    for kind, name in (("params", "weights"), ("grads", "gradients"),
                       ("optimizer", "fp32 masters + Adam moments")):
        if rep.bytes[kind]["device"]:
            out.items[name] = rep.bytes[kind]["device"]
        if rep.bytes[kind]["offload"]:
            out.host[name] = rep.bytes[kind]["offload"]
    if cfg.checkpoint.async_save:  # a host copy of what the rank saves, while it is written
        out.host[ASYNC_STAGING_ITEM] = sum(rep.bytes[kind][where] for kind in ("params",
                                           "optimizer") for where in ("device", "offload"))
    # the 1-bit optimizers' error feedback etc. on lines of their own, beside the moments
    held = out.host if rep.bytes["optimizer"]["offload"] else out.items
    for name, nbytes in onebit.items():
        held["fp32 masters + Adam moments"] -= nbytes
        held[name] = nbytes
    sdpa_math = not flash and uses_sdpa_math(cfg, device_is_cpu)
    out.items["activations"] = _peak_activation_bytes(cfg, pp_rank, num_microbatches, flash,
                                                      sdpa_math)
    if cfg.precision.fp8_format is not None:  # one GEMM's FP8 operand copies, while it runs
        from megazero.planner.fp8_cost import cast_buffer_bytes

        out.items[FP8_CAST_ITEM] = cast_buffer_bytes(cfg)
    beside_loss = loss_transient_bytes(cfg, cfg.train.micro_batch_size, p.tp)
    if pp_rank == p.pp - 1 and beside_loss:
        out.items["16-bit logits beside the loss's fp32 buffer"] = beside_loss
    ps = cfg.precision.params_dtype.itemsize
    gs = cfg.precision.grad_dtype.itemsize  # 4 for bf16 by default (fp32 accumulation)
    accumulate = gs != ps  # every backward adds param.grad into the wider ZeRO buffers
    # the last micro-batch's backward: its own activations (a schedule of one micro-batch)
    layers = cfg.model.num_layers // (p.pp * (cfg.vpp or 1))
    out.sync["activations (last micro-batch)"] = sum(
        chunk_saved_bytes(cfg, pp_rank, flash=flash, sdpa_math=sdpa_math)) + segment_peak_bytes(
        cfg, cfg.train.micro_batch_size, p.tp, layers, flash, sdpa_math)
    if z.stage == 2:
        # every micro-batch's gradients are reduced into the shards as its buckets fill, during
        # each backward (beside its activations): the bucket filling, with overlap_comm the
        # one in flight, and the reduction's output (a shard; on gloo, whose reduce-scatter is
        # an all-to-all, a full-size receive buffer too)
        bucket = min(out.numel, z.reduce_bucket_size) * gs
        receive = bucket if device_is_cpu and dp > 1 else 0
        out.items["ZeRO-2 gradient buckets"] = (
            bucket * (2 if z.overlap_comm else 1) + bucket / dp + receive)
    elif z.stage == 1:  # reduce-scatter outputs
        out.sync["ZeRO buckets"] = min(out.numel, z.reduce_bucket_size) * gs / dp
    if z.stage < 2 and not z.contiguous_gradients and not accumulate:
        # gradients live in autograd's own tensors until the last micro-batch's backward
        # copies them into the buckets (no views into a flat buffer)
        out.items["autograd gradients (accumulating)"] = out.numel * gs
        out.sync["autograd gradients (accumulating)"] = out.numel * gs
    elif z.stage == 3:
        # gathered units (live + prefetch); during the last micro-batch's backward (the sync
        # phase, while its activations are freed), the largest unit's gradients as autograd
        # made them and gradient buckets (stage3_grads): the one filling, on gloo the
        # all_to_all's receive buffer of the one being reduced, and with overlap_comm the
        # previous bucket still in flight
        topo = shape_topology(layout, pp_rank, 0, 0)
        edp = layout.edp if layout.ep != layout.tp else None  # as model_state_report's
        parts = [zero3_layout(cfg, c, topo, dp, edp) for c in chunks]
        largest = max((x.largest_unit for x in parts), default=0)
        bucket = max((n for x in parts for n in x.buckets), default=0)
        many = sum(len(x.buckets) for x in parts) > 1
        gathered = min(out.numel, z.stage3_max_live_parameters + z.stage3_prefetch_bucket_size)
        out.items["ZeRO gathered params + prefetch"] = gathered * ps
        # every micro-batch's buckets are reduced as they fill (stage3_grads): during each
        # backward, as the activations it frees make room (the phase of one micro-batch's
        # backward, which the last one's stands for)
        out.sync["ZeRO-3 gradient buckets being reduced"] = (
            largest + bucket * (1 + int(device_is_cpu) + int(z.overlap_comm and many))) * gs
    # The step works one sub-group at a time (on the host if offloaded): 16-bit runs cast its
    # gradients to fp32; a foreach update (SGD, Lion) keeps one fp32 temporary of the
    # sub-group's size (divided and shifted in place). Adam runs torch's fused
    # kernel on host and CUDA masters (megazero.zero.optimizers.update_kernel): no temporary.
    shard = out.numel / (dp if z.stage else 1)
    sub = min(shard, z.sub_group_size) * 4
    on_host = z.offload_optimizer.enabled or device_is_cpu
    step = out.host if z.offload_optimizer.enabled else out.step
    if ps != 4 or z.offload_optimizer.enabled:
        if on_host:
            (out.host if z.offload_optimizer.enabled else out.items)[GRAD_STAGING_ITEM] = sub
        else:
            step["fp32 grad sub-group"] = sub
    if cfg.optimizer.optimizer not in ("adam", "adamw"):  # Adam: fused on the host and CUDA
        step["optimizer update temporary"] = sub
    # Not counted: buffers the collective library allocates for itself (NCCL's channels,
    # gloo's flat staging copy of an all-gather's output), which CUDA's allocator statistics
    # do not see either.
    if p.pp > 1:  # receive buffers for one activation and one gradient
        m = cfg.model
        out.items["pipeline p2p buffers"] = 2 * ps * m.seq_length // p.cp \
            * cfg.train.micro_batch_size \
            * m.hidden_size / (p.tp if sp else 1)
    if not device_is_cpu:
        out.items[FRAGMENTATION_ITEM] = FRAGMENTATION * out.device_total
    return out


@dataclass
class Estimate:
    config: MegazeroConfig
    cluster: Cluster
    ranks: list[RankMemory]
    time: Any  # StepTime
    # step_time's arguments besides the config and cluster, for :meth:`retime`
    timing: dict[str, Any] = field(default_factory=dict)

    def retime(self, cluster: Cluster) -> Any:
        """The step time of the same run on ``cluster`` (memory unchanged): what a sweep over
        a cluster's assumed numbers re-evaluates."""
        from megazero.planner.step_time import step_time

        return step_time(self.config, cluster, **self.timing)

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
                "device_bytes_during_step": w.step,
                "device_bytes_during_grad_sync": w.sync,
                "device_total": w.device_total, "host_bytes_per_rank": w.host,
                "per_stage_device_total": [r.device_total for r in self.ranks],
                "device_capacity": self.cluster.memory_bytes, "fits": self.fits,
                **self.time.as_dict()}


def estimate(cfg: MegazeroConfig, cluster: Cluster, num_microbatches: int | None = None,
             flash: bool | None = None, stages: list[int] | None = None,
             p2p_scatter_gather: bool = False, features: Any = None) -> Estimate:
    """``stages``: the pipeline ranks to evaluate (default all; the layout search passes the
    first and last, which hold the most activations and the embedding / logits).
    ``p2p_scatter_gather``: time the pipeline's sends as Megatron's scatter/gather does
    (:func:`megazero.planner.step_time.step_time`). ``features``: a
    :class:`megazero.planner.features.Features` the step time prices (default: what ``cfg``
    turns on); memory is the config's."""
    from megazero.planner.step_time import step_time

    dp = cfg.layout().dp
    t = cfg.train
    gbs = t.global_batch_size or t.micro_batch_size * dp
    m = num_microbatches or max(1, gbs // (t.micro_batch_size * dp))
    cpu = cluster.name == "cpu"
    if flash is None:
        flash = not core_attention_saves_scores(cfg, cpu)
    ranks = [rank_memory(cfg, r, m, flash=flash, device_is_cpu=cpu)
             for r in (stages if stages is not None else range(cfg.parallel.pp))]
    units = buckets = 0
    if cfg.zero.stage == 3:
        for c in meta_chunks(cfg, shape_topology(cfg.layout())):
            own = cfg.layout().ep != cfg.layout().tp  # experts' buckets apart (edp != dp)
            layout = zero3_layout(cfg, c, shape_topology(cfg.layout()), dp=1,
                                  edp=1 if own else None)
            units += layout.gathered
            buckets += len(layout.buckets)
    timing = dict(num_microbatches=m, params_per_rank=ranks[0].numel, zero3_units=units,
                  zero3_buckets=buckets, flash=flash, p2p_scatter_gather=p2p_scatter_gather,
                  features=features)
    return Estimate(cfg, cluster, ranks, step_time(cfg, cluster, **timing), timing)
