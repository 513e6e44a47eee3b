"""Exposed tensor- and expert-parallel communication of a run, without and with the overlaps
megazero runs (``--tp-comm-overlap``; for expert parallelism
``--overlap-moe-expert-parallel-comm`` where the layout can run it, else
``--moe-shared-expert-overlap``), for the tools to print.

Both numbers come from the one step-time model (:mod:`megazero.planner.step_time`), priced
once with every overlap off and once with every overlap the layout can use on (TP overlap
needs sequence parallelism; the combined 1F1B what its config check asks,
:func:`megazero.config.schema.check_ep_overlap`; the shared-expert overlap, which the combined
1F1B excludes, a shared expert, expert parallelism and the alltoall dispatcher), whatever the
run's own flags say, so a user sees what the flag buys before turning it on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.errors import ConfigError
from megazero.planner.cluster import Cluster
from megazero.planner.features import Features, features_from_config
from megazero.planner.step_time import StepTime

# the overlap's lost GEMM efficiency counts against it: it is the price of hiding the rest
TP_TERMS = ("tensor parallel", "TP overlap chunking")
EP_TERMS = ("MoE dispatch", "MoE combine")
COMBINED_FLAG = "--overlap-moe-expert-parallel-comm"
SHARED_FLAG = "--moe-shared-expert-overlap"


@dataclass(frozen=True)
class ExposedComm:
    """Seconds per step of exposed TP and EP communication and the step, per mode.
    ``ep_paired``: with the combined 1F1B as the EP overlap, the share of the micro-batches
    it pairs (:func:`megazero.planner.moe_cost.paired_share`), else None. ``tp_chunking``: the
    part of ``tp_overlap`` that is GEMM efficiency lost to the overlap's sequence chunks
    (:func:`megazero.planner.tp_cost.overlap_chunking_seconds`), not communication."""

    step_plain: float
    tp_plain: float
    ep_plain: float
    step_overlap: float
    tp_overlap: float
    ep_overlap: float
    ep_paired: float | None = None
    tp_chunking: float = 0.0

    def lines(self, cfg: MegazeroConfig) -> list[str]:
        def pct(x: float, step: float) -> str:
            return f"{x:.3f} s ({x / step:.1%} of the step)" if step else "0"

        out = []
        if self.tp_plain:
            on = " (this run)" if cfg.parallel.tp_comm_overlap else ""
            chunks = (f", of it {self.tp_chunking:.3f} s the chunked GEMMs' lost efficiency"
                      if self.tp_chunking else "")
            out.append(f"exposed TP communication: {pct(self.tp_plain, self.step_plain)}; "
                       f"with --tp-comm-overlap{on} {pct(self.tp_overlap, self.step_overlap)}"
                       f"{chunks}"
                       if self.tp_overlap != self.tp_plain else
                       f"exposed TP communication: {pct(self.tp_plain, self.step_plain)} "
                       "(--tp-comm-overlap needs --sequence-parallel)")
        if self.ep_plain:
            plain = f"exposed EP communication: {pct(self.ep_plain, self.step_plain)}"
            if self.ep_overlap == self.ep_plain:
                out.append(plain)
            elif self.ep_paired is not None:
                on = " (this run)" if cfg.parallel.overlap_moe_expert_parallel_comm else ""
                out.append(f"{plain}; with {COMBINED_FLAG}{on} "
                           f"{pct(self.ep_overlap, self.step_overlap)}, "
                           f"{self.ep_paired:.1%} of the forwards paired with a backward")
            else:
                on = " (this run)" if cfg.model.moe.moe_shared_expert_overlap else ""
                out.append(f"{plain}; with {SHARED_FLAG}{on} "
                           f"{pct(self.ep_overlap, self.step_overlap)}")
        return out


def combined_1f1b_fits(cfg: MegazeroConfig) -> bool:
    """Whether the layout can run ``--overlap-moe-expert-parallel-comm``: the config validates
    (:func:`megazero.config.schema.check_ep_overlap`) with it on and the shared-expert
    overlap, which it excludes, off."""
    moe = replace(cfg.model.moe, moe_shared_expert_overlap=False)
    try:
        replace(cfg, model=replace(cfg.model, moe=moe),
                parallel=replace(cfg.parallel, overlap_moe_expert_parallel_comm=True))
    except ConfigError:
        return False
    return True


def overlap_features(cfg: MegazeroConfig, base: Features) -> Features:
    """``base`` with every overlap megazero runs that this layout can use turned on: of the
    two EP overlaps the combined 1F1B where it fits, else the shared-expert overlap."""
    moe = cfg.model.moe
    combined = combined_1f1b_fits(cfg)
    shared = (not combined and moe.moe_shared_expert_intermediate_size is not None
              and moe.moe_token_dispatcher_type == "alltoall" and cfg.layout().ep > 1)
    return replace(base,
                   tp_comm_overlap=sequence_parallel_active(cfg.parallel.sequence_parallel,
                                                            cfg.parallel.tp),
                   moe_shared_expert_overlap=shared, moe_ep_overlap=combined)


def exposed_comm(cfg: MegazeroConfig, cluster: Cluster, base: Features | None = None
                 ) -> ExposedComm:
    """Exposed TP / EP seconds per step with the overlaps off and on."""
    from megazero.planner.estimate import estimate
    from megazero.planner.moe_cost import paired_share

    base = base if base is not None else features_from_config(cfg)
    plain = replace(base, tp_comm_overlap=False, moe_shared_expert_overlap=False,
                    moe_ep_overlap=False)
    over = overlap_features(cfg, base)
    stages = sorted({0, cfg.parallel.pp - 1})
    e0 = estimate(cfg, cluster, stages=stages, features=plain)
    t0 = e0.time
    t1 = estimate(cfg, cluster, stages=stages, features=over).time
    p = cfg.parallel
    paired = (paired_share(p.pp, cfg.vpp, e0.timing["num_microbatches"], p.pipeline_schedule,
                           p.microbatch_group_size_per_vp_stage)
              if over.moe_ep_overlap else None)

    def total(t: StepTime, names: tuple[str, ...]) -> float:
        return sum(t.terms.get(n, 0.0) for n in names)

    return ExposedComm(t0.seconds, total(t0, TP_TERMS), total(t0, EP_TERMS),
                       t1.seconds, total(t1, TP_TERMS), total(t1, EP_TERMS), paired,
                       total(t1, ("TP overlap chunking",)))
