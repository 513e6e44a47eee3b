"""One layout the search kept: its flags and its estimate, and how tables name it."""

from __future__ import annotations

from dataclasses import dataclass

from megazero.planner.estimate import Estimate


@dataclass
class Candidate:
    flags: list[str]
    est: Estimate

    @property
    def label(self) -> str:
        """Every axis of the layout: ``tp2 cp1 pp4 interleaved x2 dp8 ep8 etp1 z1 rc=none
        sp=on mbs=1`` (expert axes for MoE models only)."""
        c = self.est.config
        p, z = c.parallel, c.zero
        rc = p.recompute.granularity or "none"
        off = "+off" if z.offload_optimizer.enabled else ""
        per_stage = c.model.num_layers // p.pp
        vl = p.num_layers_per_virtual_pipeline_stage
        sched = p.pipeline_schedule or (
            "1f1b" if vl is None else f"interleaved x{per_stage // vl}")
        moe = (f" ep{p.expert_model_parallel_size} etp{p.expert_tensor_parallel_size}"
               if c.model.moe.enabled else "")
        return (f"tp{p.tp} cp{p.cp} pp{p.pp} {sched} dp{c.layout().dp}{moe} z{z.stage}{off} "
                f"rc={rc} sp={'on' if p.sequence_parallel else 'off'} "
                f"mbs={c.train.micro_batch_size}")
