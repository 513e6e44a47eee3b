"""The pipeline bubble the planner predicts: the schedule megazero runs, simulated by the
checker, with what a message and an action cost on the machine.

The paper formulas (1F1B's ``(p - 1) / m``, the zero-bubble paper's thirds and sixths) take
messages and actions to be free. They are not: every exchange step waits a message latency
after its last peer posts, and every F, B or W spends time outside its compute (autograd,
the executor's bookkeeping, the chunk's small ops). Both sit on the critical path and count
as bubble, and the zero-bubble schedules have more of both: ZBV and DualPipeV run 3 actions
per chunk and micro-batch over 2 chunks (6 per micro-batch and stage, 1F1B's 2) and twice the
exchanges, so on a machine where an action costs milliseconds their bubble is well above the
free-action sixth. The simulation charges each exchange step ``p2p_s`` once every peer has
posted and each compute action ``action_s`` before it starts, busy time excluded, and reports
the bubble as ``bench/pipeline_bubble.py`` measures it: per rank, idle over busy time.

Where the numbers come from: ``PipelineCosts`` holds measurements, not fitted constants.
``bench/pipeline_bubble.py`` measures both in its own gloo world right before the schedules
run, as the pipeline meets them: ``p2p_ms``, the median one-way time of one activation message
to a rank already waiting for it, the sender posting after a sleep; ``action_overhead_ms``,
the median time an F, B or W of a zero-compute chunk spends, each run after a sleep (a rank
wakes to every action and message; on a loaded machine that wake-up, not the copy or the
autograd call, is most of the cost, and back-to-back loops measure an order of magnitude
less). Both are recorded in ``bench/results/pipeline_bubble.json``, and
``tests/test_pipeline_bubble_prediction.py`` holds the prediction to the measured bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.pipeline.checker import SimResult, check_schedules
from megazero.pipeline.zero_bubble import ZERO_BUBBLE, all_schedule_steps


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds one exchange step (``p2p_s``) and one compute action (``action_s``) add."""

    p2p_s: float = 0.0
    action_s: float = 0.0


def simulate(schedule: str, pp: int, vpp: int, microbatches: int, stage_f_s: float,
             costs: PipelineCosts = PipelineCosts(), delay_wgrad: bool = False) -> SimResult:
    """The checker's simulation of ``schedule`` ("1f1b" with ``vpp`` chunks for 1F1B and
    interleaved 1F1B, or a :data:`ZERO_BUBBLE` name) on ``pp`` stages whose forward of one
    micro-batch takes ``stage_f_s`` seconds, the input and weight gradients as long (the
    bench's and the paper's F = B = W), split evenly over the stage's chunks."""
    placement, zb_vpp = ZERO_BUBBLE.get(schedule, ("loop", vpp))
    v = zb_vpp if schedule in ZERO_BUBBLE else vpp
    steps = all_schedule_steps(pp, v if v > 1 else None, microbatches,
                               schedule=schedule if schedule in ZERO_BUBBLE else None,
                               delay_wgrad=delay_wgrad)
    f = stage_f_s / v
    return check_schedules(steps, v, microbatches, f_time=f, b_time=2 * f, w_time=f,
                           placement=placement, memory_bound=False, p2p_time=costs.p2p_s,
                           action_overhead=costs.action_s)


def bubble_fraction(schedule: str, pp: int, vpp: int, microbatches: int, stage_f_s: float,
                    costs: PipelineCosts = PipelineCosts(), delay_wgrad: bool = False
                    ) -> float:
    """Mean over ranks of idle over busy time in one step (the bench's ``measured_mean``)."""
    res = simulate(schedule, pp, vpp, microbatches, stage_f_s, costs, delay_wgrad)
    fractions = res.bubble_fraction
    return sum(fractions) / len(fractions)
