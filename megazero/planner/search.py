"""Find the fastest layouts of a run that fit: every axis enumerated, timed first, memory
estimated only where it can matter.

The layouts (:mod:`.layouts`: TP, CP, PP and its schedule, EP and ETP, SP, micro-batch, ZeRO
stage, offload, recomputation) are each timed by the step-time model
(:func:`megazero.planner.step_time.step_time`, with the rank's parameters counted from cached
layers, :mod:`.layer_params`), then taken fastest first: a layout whose model states and
activations alone (a lower bound of its memory) exceed the device is pruned; the others get the
full memory estimate (:func:`megazero.planner.estimate.estimate`, first and last pipeline
stage) until ``keep`` layouts fit. A layout that does not fit brings its offloaded twin into
the race (slower and smaller: it can never beat the layout it comes from, so it is timed only
where that one does not fit).
The stage-3 parameter gathers' latency needs the units of the whole model: a stage-3 layout is
timed without it first (a lower bound) and exactly when it comes up. The layouts kept are
checked once more through ``load_config`` of their flags, so the winner is what the run reads.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from megazero.config import ConfigError, MegazeroConfig, flag_values, load_config, parse_args
from megazero.config.optim_schema import nccl_zero_defaults
from megazero.planner.activations import (
    core_attention_saves_scores,
    peak_saved_bytes,
    uses_sdpa_math,
)
from megazero.planner.candidate import Candidate
from megazero.planner.cluster import Cluster, planning_argv
from megazero.planner.estimate import estimate, zero3_layout
from megazero.planner.layer_params import stage_numel
from megazero.planner.layouts import (
    RECOMPUTE,
    Layout,
    Shape,
    fixed_axes,
    layout_config,
    microbatch_sizes,
    shapes,
)
from megazero.planner.plan_report import (  # noqa: F401 (the tool's and tests' one import)
    assumptions,
    deepspeed_json,
    dumps,
    runner_up,
    why_slower,
    why_winner,
    winner_flags,
)
from megazero.planner.shapes import meta_chunks, shape_topology
from megazero.planner.step_time import step_time

#: called as the search goes: (what it counts: "shapes timed" or "layouts tried", how many so
#: far, of how many known now, the fastest layout found to fit so far or None)
ProgressFn = Callable[[str, int, int, "Candidate | None"], None]


@dataclass
class SearchResult:
    fits: list[Candidate]  # the fastest layouts that fit, fastest first
    timed: int = 0  # layouts whose step time was predicted
    checked: int = 0  # layouts whose memory was estimated in full
    pruned: int = 0  # layouts whose model states and activations alone exceed the device
    shapes: int = 0  # (tp, cp, pp, schedule, ep, etp, sp) combinations
    closest: Candidate | None = None  # when nothing fits: the one needing the least memory
    invalid: int = 0  # layouts the run would refuse (heads not divisible by tp...)
    also: Candidate | None = None  # the fastest fitting layout ``also`` asked for


def _config(base: list[str], flags: list[str], world: int, cluster: Cluster | None = None
            ) -> MegazeroConfig:
    """The config of ``base`` + a layout's ``flags`` as the run reads it (``--offload-optimizer``
    is the planner's marker for the JSON's ``offload_optimizer`` block)."""
    from megazero.config import OffloadConfig

    off = "--offload-optimizer" in flags
    argv = planning_argv(base, cluster) if cluster is not None else base
    cfg = load_config(argv + [f for f in flags if f != "--offload-optimizer"], world)
    if off:
        cfg = replace(cfg, zero=replace(cfg.zero, offload_optimizer=OffloadConfig(device="cpu")))
    return cfg


def _user_fields(argv: list[str], typed: dict[str, Any]) -> set[str]:
    """Config fields the user set (flags, or keys of ``--deepspeed_config``)."""
    fields = set(flag_values(typed))
    path = typed.get("deepspeed_config")
    if path:
        from megazero.config import load_ds_json
        from megazero.config.deepspeed import check_ds_config, json_field_values

        fields |= set(json_field_values(check_ds_config(load_ds_json(path))[0]))
    return fields


@dataclass
class _Search:
    base: MegazeroConfig
    cluster: Cluster
    world: int
    gbs: int
    nccl: set[str] | None
    fixed: dict[str, Any]
    result: SearchResult = field(default_factory=lambda: SearchResult([]))
    heap: list[tuple[float, int, Layout, MegazeroConfig, bool]] = field(default_factory=list)
    seen: set[Layout] = field(default_factory=set)
    units: dict[Shape, tuple[int, int]] = field(default_factory=dict)
    order: Any = field(default_factory=itertools.count)

    @property
    def cpu(self) -> bool:
        return self.cluster.name == "cpu"

    def microbatches(self, cfg: MegazeroConfig) -> int:
        return self.gbs // (cfg.train.micro_batch_size * cfg.layout().dp)

    def flash(self, cfg: MegazeroConfig) -> bool:
        return not core_attention_saves_scores(cfg, self.cpu)

    def seconds(self, layout: Layout, cfg: MegazeroConfig, exact: bool) -> float:
        units = buckets = 0
        if layout.stage == 3 and exact:
            units, buckets = self.zero3_units(layout.shape, cfg)
        return step_time(cfg, self.cluster, self.microbatches(cfg), stage_numel(cfg, 0),
                         units, buckets, flash=self.flash(cfg)).seconds

    def zero3_units(self, shape: Shape, cfg: MegazeroConfig) -> tuple[int, int]:
        """Stage-3 units gathered and gradient buckets of the whole model, as
        :func:`estimate` counts them (cached per shape)."""
        if shape not in self.units:
            layout = cfg.layout()
            own = layout.ep != layout.tp
            parts = [zero3_layout(cfg, c, shape_topology(layout), dp=1, edp=1 if own else None)
                     for c in meta_chunks(cfg, shape_topology(layout))]
            self.units[shape] = (sum(x.gathered for x in parts), sum(len(x.buckets)
                                                                     for x in parts))
        return self.units[shape]

    def push(self, layout: Layout) -> None:
        if layout in self.seen:
            return
        self.seen.add(layout)
        try:
            cfg = layout_config(self.base, layout, self.world, self.gbs, self.nccl)
        except ConfigError:
            self.result.invalid += 1
            return
        exact = layout.stage != 3  # stage 3: timed without the gathers' latency first
        heapq.heappush(self.heap, (self.seconds(layout, cfg, exact), next(self.order), layout,
                                   cfg, exact))
        self.result.timed += 1

    def memory_floor(self, cfg: MegazeroConfig) -> float:
        """Device bytes rank 0 holds at least: its model states (sharded over the widest group
        ZeRO may use) and the activations its schedule keeps at its peak."""
        from megazero.zero.optimizers import state_layout

        z, layout = cfg.zero, cfg.layout()
        n = stage_numel(cfg, 0)
        shard = max(layout.dp * layout.cp, layout.edp)
        e, g = cfg.precision.params_dtype.itemsize, cfg.precision.grad_dtype.itemsize
        moments, _ = state_layout(cfg.optimizer)
        weights = e * n / (shard if z.stage == 3 else 1)
        grads = g * n / (shard if z.stage >= 2 else 1)
        copy = 4 if e != 4 else 0
        states = 0.0 if z.offload_optimizer.enabled else (copy + 4 * moments) * n / (
            shard if z.stage >= 1 else 1)
        flash = self.flash(cfg)
        acts = peak_saved_bytes(cfg, 0, self.microbatches(cfg), flash=flash,
                                sdpa_math=not flash and uses_sdpa_math(cfg, self.cpu))
        return weights + grads + states + acts

    def run(self, keep: int, progress: ProgressFn | None,
            also: Callable[[Candidate], bool] | None = None) -> SearchResult:
        res = self.result
        smallest: tuple[float, Layout, MegazeroConfig] | None = None
        def more() -> bool:
            """Keep going: too few fit, none slower than the winner (the runner-up the report
            compares it with), or the layout ``also`` asks for is still to find."""
            slower = res.fits and res.fits[-1].est.time.seconds > res.fits[0].est.time.seconds * (
                1 + 1e-9)
            return len(res.fits) < keep or not slower or (also is not None and res.also is None)

        while self.heap and more():
            seconds, _, layout, cfg, exact = heapq.heappop(self.heap)
            if progress is not None:
                progress("layouts tried", res.checked + res.pruned,
                         res.checked + res.pruned + len(self.heap),
                         res.fits[0] if res.fits else None)
            if not exact:  # its exact time is no smaller: back in line
                heapq.heappush(self.heap, (self.seconds(layout, cfg, True), next(self.order),
                                           layout, cfg, True))
                continue
            floor = self.memory_floor(cfg)
            if smallest is None or floor < smallest[0]:
                smallest = (floor, layout, cfg)
            if floor > self.cluster.memory_bytes:
                res.pruned += 1
            else:
                try:
                    est = estimate(cfg, self.cluster, stages=sorted({0, cfg.parallel.pp - 1}))
                except ConfigError:  # a layout the model cannot be built at
                    res.invalid += 1
                    continue
                res.checked += 1
                cand = Candidate(layout.flags(self.gbs), est)
                if est.fits:
                    res.fits.append(cand)
                    if also is not None and res.also is None and also(cand):
                        res.also = cand
                    continue
                if res.closest is None or (est.worst.device_total
                                           < res.closest.est.worst.device_total):
                    res.closest = cand
            twin = layout.twin()
            if twin is not None:
                self.push(twin)
        if not res.fits and res.closest is None and smallest is not None:
            _, layout, cfg = smallest
            est = estimate(cfg, self.cluster, stages=sorted({0, cfg.parallel.pp - 1}))
            res.closest = Candidate(layout.flags(self.gbs), est)
        return res


def uses_experts(c: Candidate) -> bool:
    """A layout with expert parallelism (``also`` for MoE models)."""
    return c.est.config.parallel.expert_model_parallel_size > 1


def search(base: list[str], world: int, cluster: Cluster, gbs: int,
           stages: tuple[int, ...] = (0, 1, 2, 3), keep: int = 10,
           progress: ProgressFn | None = None,
           also: Callable[[Candidate], bool] | None = None) -> SearchResult:
    """The ``keep`` fastest layouts of ``base`` (pretrain_gpt.py flags) on ``world`` ranks of
    ``cluster`` at global batch ``gbs`` that fit, fastest first (see the module's doc); with
    ``also``, the search goes on until the fastest fitting layout it accepts is found too
    (``result.also``: e.g. the best with expert parallelism when the winner has none)."""
    argv = planning_argv(base, cluster)
    cfg = load_config(argv, world)  # the user's flags as the run reads them (errors: theirs)
    typed = vars(parse_args(argv))
    user = _user_fields(argv, typed)
    nccl = None
    if (cfg.parallel.distributed_backend or "gloo") == "nccl":
        nccl = {k for k in nccl_zero_defaults(1) if f"zero.{k}" not in user}
    fixed = fixed_axes(typed, cfg)
    s = _Search(cfg, cluster, world, gbs, nccl, fixed)
    every = list(shapes(cfg, world, cluster.gpus_per_node, fixed))
    for i, shape in enumerate(every):
        s.result.shapes += 1
        if progress is not None:
            progress("shapes timed", i, len(every), None)
        for mbs in microbatch_sizes(shape, world, gbs, fixed):
            for stage in ([fixed["stage"]] if "stage" in fixed else stages):
                for rc in ([fixed["rc"]] if "rc" in fixed else RECOMPUTE):
                    s.push(Layout(shape, mbs, stage, False, rc))
    res = s.run(max(keep, 2), progress, also)

    def as_read(c: Candidate) -> Candidate:
        """What the run reads from the flags: the same config, estimated once more."""
        cfg = _config(base, c.flags, world, cluster)
        return Candidate(c.flags, estimate(cfg, cluster, stages=sorted({0, cfg.parallel.pp - 1})))

    res.fits = sorted((as_read(c) for c in res.fits), key=lambda c: c.est.time.seconds)
    if res.also is not None:
        res.also = as_read(res.also)
    return res
