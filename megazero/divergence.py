"""Non-finite steps: count them, stop a diverged run with one message, never save their state.

A NaN/inf loss or gradient skips its update (:meth:`megazero.zero.ZeroOptimizer.step`, fp32 and
bf16 as fp16's overflow skip does), so one bad batch costs one step. Several in a row mean the
weights themselves are bad: the run stops (``--max-nonfinite-steps``), and the checkpoint it
would write is refused, so ``latest`` keeps naming the last sound one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megazero.errors import MegazeroError

if TYPE_CHECKING:
    from megazero.topology import ParallelTopology


class TrainingDivergedError(MegazeroError, RuntimeError):
    """The loss or gradients stayed NaN/inf for ``--max-nonfinite-steps`` iterations in a row.
    Raised on every rank alike (the decision is all-reduced), after nothing was saved. Its
    exit status (3) tells a job scheduler not to requeue the run as it is."""

    exit_code = 3


def params_finite(chunks: list[torch.nn.Module], topo: ParallelTopology,
                  device: torch.device) -> bool:
    """Every rank's weights are finite (one MAX all-reduce): the last guard before a save."""
    bad = any(not torch.isfinite(p).all() for c in chunks for p in c.parameters() if p.numel())
    flag = torch.tensor([float(bad)], device=device)
    if topo.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def note_nonfinite(state: Any, train_cfg: Any, nonfinite: bool, loss: float,
                   saved_at: int | None, save_dir: str | None) -> None:
    """Count NaN/inf steps in a row in ``state.nonfinite_streak`` (the loss is the global
    mean, the same on every rank; ``nonfinite`` is all-reduced by the engine); raise
    :class:`TrainingDivergedError` at ``--max-nonfinite-steps``."""
    if not (nonfinite or not math.isfinite(loss)):
        state.nonfinite_streak = 0
        return
    state.nonfinite_streak += 1
    t = train_cfg
    if not t.check_for_nan_in_loss_and_grad or state.nonfinite_streak < t.max_nonfinite_steps:
        return
    last = (f"the latest checkpoint (iteration {saved_at}) in {save_dir} is untouched"
            if saved_at is not None and save_dir else "no checkpoint was written")
    raise TrainingDivergedError(
        f"training diverged at iteration {state.iteration}: the loss or gradients were NaN/inf "
        f"for {state.nonfinite_streak} iterations in a row (--max-nonfinite-steps "
        f"{t.max_nonfinite_steps}); their updates were skipped and {last}. Resume from it "
        f"with a lower --lr, more --lr-warmup-iters or --clip-grad, or check the data")
