"""The layouts a run could use: every axis megazero has, enumerated, and each layout as a
validated config without a trip through the command-line parser.

A layout is a :class:`Shape` (tensor, context, pipeline, expert and expert-tensor parallel
sizes, the pipeline schedule, sequence parallelism) plus what varies inside a shape
(:class:`Layout`: micro-batch size, ZeRO stage, optimizer offload, recomputation). Axes the user
typed (``--tensor-model-parallel-size 4``...) are fixed at the typed value. Context parallelism
is tried for long sequences (:data:`CP_FROM_SEQ` tokens and more), expert parallelism (and
expert tensor parallelism at the TP size, Megatron's default) for MoE models.

:func:`layout_config` builds a layout's :class:`~megazero.config.MegazeroConfig` from the base
config with ``dataclasses.replace`` (each section validates itself, as in a launch), applying
the merge's NCCL defaults that depend on the layout (bucket size by dp); the search checks its
final candidates through ``load_config`` of their flags as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from megazero.config import ConfigError, MegazeroConfig, OffloadConfig
from megazero.config.optim_schema import nccl_zero_defaults
from megazero.config.rules import divisors
from megazero.planner.schedule_options import ScheduleChoice, runs_with, schedule_choices

#: sequences this long or longer are tried with context parallelism
CP_FROM_SEQ = 8192
#: the shortest per-rank sequence context parallelism is tried down to
CP_MIN_LOCAL_SEQ = 2048
MICRO_BATCHES = (1, 2, 4, 8)
#: the recomputation settings, by memory (most first): none is the fastest, but selective (the
#: attention core again) and full (every layer's forward, attention kernels aside) are not
#: ordered by time, so the search times all three
RECOMPUTE = ("none", "selective", "full")

#: typed flag (argparse dest) -> the axis it fixes
AXIS_FLAGS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
              "context_parallel_size": "cp", "expert_model_parallel_size": "ep",
              "expert_tensor_parallel_size": "etp", "sequence_parallel": "sp",
              "num_layers_per_virtual_pipeline_stage": "vl", "micro_batch_size": "mbs",
              "recompute_granularity": "rc", "zero_stage": "stage"}


@dataclass(frozen=True)
class Shape:
    tp: int
    cp: int
    pp: int
    schedule: ScheduleChoice
    ep: int
    etp: int
    sp: bool


@dataclass(frozen=True)
class Layout:
    shape: Shape
    mbs: int
    stage: int
    offload: bool = False
    recompute: str = "none"

    def flags(self, gbs: int) -> list[str]:
        s = self.shape
        out = [f"--tensor-model-parallel-size={s.tp}", f"--pipeline-model-parallel-size={s.pp}",
               f"--zero-stage={self.stage}", f"--micro-batch-size={self.mbs}",
               f"--global-batch-size={gbs}", *s.schedule.flags()]
        if s.cp > 1:
            out.append(f"--context-parallel-size={s.cp}")
        if s.ep > 1 or s.etp > 1:
            out += [f"--expert-model-parallel-size={s.ep}",
                    f"--expert-tensor-parallel-size={s.etp}"]
        if self.recompute == "selective":
            out.append("--recompute-granularity=selective")
        elif self.recompute == "full":
            out += ["--recompute-granularity=full", "--recompute-method=uniform",
                    "--recompute-num-layers=1"]
        if s.sp:
            out.append("--sequence-parallel")
        if self.offload:
            out.append("--offload-optimizer")  # planner-only marker (search._config)
        return out

    def twin(self) -> Layout | None:
        """The slower, smaller variant: the optimizer offloaded (ZeRO 1-3), which only adds
        time (its state crosses PCIe and steps on the host instead of the device)."""
        return replace(self, offload=True) if not self.offload and self.stage > 0 else None


def fixed_axes(typed: dict[str, Any], base: MegazeroConfig) -> dict[str, Any]:
    """The axes the user typed, with the values the base config holds for them."""
    p, fixed = base.parallel, {}
    values = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.expert_model_parallel_size,
              "etp": p.expert_tensor_parallel_size, "sp": p.sequence_parallel,
              "vl": p.num_layers_per_virtual_pipeline_stage,
              "mbs": base.train.micro_batch_size, "rc": p.recompute_granularity or "none",
              "stage": base.zero.stage}
    for dest, axis in AXIS_FLAGS.items():
        if dest in typed:
            fixed[axis] = values[axis]
    return fixed


def shapes(base: MegazeroConfig, world: int, gpus_per_node: int,
           fixed: dict[str, Any]) -> Iterator[Shape]:
    """Every shape of the world worth timing: TP within a node, CP for long sequences, PP
    dividing the layers, each schedule of :mod:`.schedule_options`, EP dividing the experts
    (ETP 1 or the TP size), SP with TP (always with MoE, which needs it)."""
    m = base.model
    seq, layers, experts = m.seq_length, m.num_layers, m.moe.num_experts

    def axis(name: str, options: list[Any]) -> list[Any]:
        return [fixed[name]] if name in fixed else options

    cps = [1] + ([c for c in (2, 4, 8, 16) if seq % (2 * c) == 0
                  and seq // c >= CP_MIN_LOCAL_SEQ] if seq >= CP_FROM_SEQ else [])
    for tp in axis("tp", [d for d in divisors(gpus_per_node) if world % d == 0]):
        for cp in axis("cp", cps):
            for pp in axis("pp", divisors(layers)):
                if world % (tp * cp * pp):
                    continue
                per_stage = layers // pp
                choices = schedule_choices(pp, per_stage)
                if "vl" in fixed:
                    choices = [c for c in choices if c.layers_per_virtual_stage == fixed["vl"]]
                eps = [1] if experts is None else [e for e in divisors(experts)
                                                   if world % (e * pp) == 0]
                for ep in axis("ep", eps):
                    etps = sorted({1, tp}) if experts is not None else [1]
                    for etp in axis("etp", etps):
                        if world % (etp * ep * pp):
                            continue
                        sps = [False] if tp == 1 else ([True] if experts else [False, True])
                        for sp in axis("sp", sps):
                            if sp and tp == 1:
                                continue
                            for choice in choices:
                                yield Shape(tp, cp, pp, choice, ep, etp, sp)


def microbatch_sizes(shape: Shape, world: int, gbs: int, fixed: dict[str, Any]) -> list[int]:
    dp = world // (shape.tp * shape.cp * shape.pp)
    out = []
    for mbs in ([fixed["mbs"]] if "mbs" in fixed else MICRO_BATCHES):
        if gbs % (mbs * dp) == 0 and runs_with(shape.schedule, shape.pp, gbs // (mbs * dp)):
            out.append(mbs)
    return out


def layout_config(base: MegazeroConfig, layout: Layout, world: int, gbs: int,
                  nccl_defaults: set[str] | None) -> MegazeroConfig:
    """``base`` at ``layout`` (validated; :class:`ConfigError` when the run would refuse it).
    ``nccl_defaults``: the ZeRO fields the merge fills with Megatron's NCCL defaults (those the
    user did not set), or None on a gloo run."""
    s = layout.shape
    full = layout.recompute == "full"
    parallel = replace(
        base.parallel, tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
        context_parallel_size=s.cp, expert_model_parallel_size=s.ep,
        expert_tensor_parallel_size=s.etp, sequence_parallel=s.sp,
        num_layers_per_virtual_pipeline_stage=s.schedule.layers_per_virtual_stage,
        pipeline_schedule=s.schedule.pipeline_schedule,
        recompute_granularity=None if layout.recompute == "none" else layout.recompute,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None, world_size=world)
    dp = world // (s.tp * s.cp * s.pp)
    if gbs % (layout.mbs * dp):
        raise ConfigError(f"global batch {gbs} is not a multiple of {layout.mbs} x dp {dp}")
    train = replace(base.train, micro_batch_size=layout.mbs, global_batch_size=gbs,
                    gradient_accumulation_steps=gbs // (layout.mbs * dp),
                    global_batch_derived=False)  # as --global-batch-size gives it
    zero = replace(base.zero, stage=layout.stage)
    if nccl_defaults:
        zero = replace(zero, **{k: v for k, v in nccl_zero_defaults(dp).items()
                                if k in nccl_defaults})
    if layout.offload:
        zero = replace(zero, offload_optimizer=OffloadConfig(device="cpu"))
    return replace(base, parallel=parallel, train=train, zero=zero)
