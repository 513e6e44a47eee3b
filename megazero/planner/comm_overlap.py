"""Exposed tensor- and expert-parallel communication of a run, without and with the overlaps
megazero runs (``--tp-comm-overlap``, ``--moe-shared-expert-overlap``), for the tools to print.

Both numbers come from the one step-time model (:mod:`megazero.planner.step_time`), priced
once with both features off and once with every overlap the layout can use on (TP overlap
needs sequence parallelism; the shared-expert overlap a shared expert, expert parallelism and
the alltoall dispatcher), whatever the run's own flags say, so a user sees what the flag buys
before turning it on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.planner.cluster import Cluster
from megazero.planner.features import Features, features_from_config
from megazero.planner.step_time import StepTime

TP_TERMS = ("tensor parallel",)
EP_TERMS = ("MoE dispatch", "MoE combine")


@dataclass(frozen=True)
class ExposedComm:
    """Seconds per step of exposed TP and EP communication and the step, per mode."""

    step_plain: float
    tp_plain: float
    ep_plain: float
    step_overlap: float
    tp_overlap: float
    ep_overlap: float

    def lines(self, cfg: MegazeroConfig) -> list[str]:
        def pct(x: float, step: float) -> str:
            return f"{x:.3f} s ({x / step:.1%} of the step)" if step else "0"

        out = []
        if self.tp_plain:
            on = " (this run)" if cfg.parallel.tp_comm_overlap else ""
            out.append(f"exposed TP communication: {pct(self.tp_plain, self.step_plain)}; "
                       f"with --tp-comm-overlap{on} {pct(self.tp_overlap, self.step_overlap)}"
                       if self.tp_overlap != self.tp_plain else
                       f"exposed TP communication: {pct(self.tp_plain, self.step_plain)} "
                       "(--tp-comm-overlap needs --sequence-parallel)")
        if self.ep_plain:
            on = " (this run)" if cfg.model.moe.moe_shared_expert_overlap else ""
            out.append(f"exposed EP communication: {pct(self.ep_plain, self.step_plain)}; "
                       f"with --moe-shared-expert-overlap{on} "
                       f"{pct(self.ep_overlap, self.step_overlap)}"
                       if self.ep_overlap != self.ep_plain else
                       f"exposed EP communication: {pct(self.ep_plain, self.step_plain)}")
        return out


def overlap_features(cfg: MegazeroConfig, base: Features) -> Features:
    """``base`` with every overlap megazero runs that this layout can use turned on."""
    moe = cfg.model.moe
    shared = (moe.moe_shared_expert_intermediate_size is not None
              and moe.moe_token_dispatcher_type == "alltoall" and cfg.layout().ep > 1)
    return replace(base,
                   tp_comm_overlap=sequence_parallel_active(cfg.parallel.sequence_parallel,
                                                            cfg.parallel.tp),
                   moe_shared_expert_overlap=shared)


def exposed_comm(cfg: MegazeroConfig, cluster: Cluster, base: Features | None = None
                 ) -> ExposedComm:
    """Exposed TP / EP seconds per step with the overlaps off and on."""
    from megazero.planner.estimate import estimate

    base = base if base is not None else features_from_config(cfg)
    plain = replace(base, tp_comm_overlap=False, moe_shared_expert_overlap=False)
    stages = sorted({0, cfg.parallel.pp - 1})
    t0 = estimate(cfg, cluster, stages=stages, features=plain).time
    t1 = estimate(cfg, cluster, stages=stages, features=overlap_features(cfg, base)).time

    def total(t: StepTime, names: tuple[str, ...]) -> float:
        return sum(t.terms.get(n, 0.0) for n in names)

    return ExposedComm(t0.seconds, total(t0, TP_TERMS), total(t0, EP_TERMS),
                       t1.seconds, total(t1, TP_TERMS), total(t1, EP_TERMS))
