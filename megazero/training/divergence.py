"""Non-finite steps and spikes: count them, stop a diverged run with one message, never save
their state.

A NaN/inf loss or gradient skips its update (:meth:`megazero.zero.ZeroOptimizer.step`, fp32 and
bf16 as fp16's overflow skip does), so one bad batch costs one step. Several in a row mean the
weights themselves are bad: the run stops (``--max-nonfinite-steps``), and the checkpoint it
would write is refused, so ``latest`` keeps naming the last sound one. A finite step can be as
bad (a loss of 1e12 after a too-high learning rate): :class:`SpikeWatch` calls it a spike, and
its state is not saved either, so the checkpoint a diverged run names is one from before the
spike began.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megazero.checkpoint.files import Writer
from megazero.checkpoint.reader import TRACKER
from megazero.errors import MegazeroError

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


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
                   saved_at: int | None, save_dir: str | None,
                   spike: SpikeWatch | None = None) -> None:
    """Count NaN/inf steps in a row in ``state.nonfinite_streak`` (the loss is the global
    mean, the same on every rank; ``nonfinite`` is all-reduced by the engine); raise
    :class:`TrainingDivergedError` at ``--max-nonfinite-steps``. When a spike
    (:class:`SpikeWatch`) came first, the message says where it began: ``saved_at`` is then
    the newest checkpoint from before it, since a spike's state is never saved."""
    if not (nonfinite or not math.isfinite(loss)):
        state.nonfinite_streak = 0
        return
    state.nonfinite_streak += 1
    t = train_cfg
    if not t.check_for_nan_in_loss_and_grad or state.nonfinite_streak < t.max_nonfinite_steps:
        return
    last = (f"the latest checkpoint (iteration {saved_at}) in {save_dir} is untouched"
            if saved_at is not None and save_dir else "no checkpoint was written")
    if spike is not None and spike.since is not None and spike.since < state.iteration:
        before = (f"the newest checkpoint saved before it is iteration {saved_at} in {save_dir}"
                  if saved_at is not None and save_dir else "no checkpoint was saved before it")
        last = (f"the run began to diverge at iteration {spike.since} ({spike.why}); nothing "
                f"was saved since, and {before}")
    raise TrainingDivergedError(
        f"training diverged at iteration {state.iteration}: the loss or gradients were NaN/inf "
        f"for {state.nonfinite_streak} iterations in a row (--max-nonfinite-steps "
        f"{t.max_nonfinite_steps}); their updates were skipped and {last}. Resume from it "
        f"with a lower --lr, more --lr-warmup-iters or --clip-grad, or check the data")


def note_spikes(state: Any, train_cfg: Any, spiked: bool, saved_at: int | None,
                save_dir: str | None) -> None:
    """Stop a run that stays in a spike (:class:`SpikeWatch`) for ``--max-spike-steps``
    iterations in a row with a :class:`TrainingDivergedError` naming the checkpoint to go back
    to: a loss that exploded and stays finite (1e3, 1e4...) never trips the NaN/inf count, and
    nothing is saved while it lasts. Every rank sees the same loss, so every rank raises."""
    spikes: SpikeWatch = state.spikes
    if not spiked or spikes.since is None:
        return
    count = state.iteration - spikes.since + 1
    if count < train_cfg.max_spike_steps:
        return
    back = (f"the newest checkpoint saved before it is iteration {saved_at} in {save_dir}. "
            f"Resume from it (--load {save_dir})" if saved_at is not None and save_dir
            else "no checkpoint was saved before it. Start again")
    raise TrainingDivergedError(
        f"training diverged at iteration {state.iteration}: {count} spiked iterations in a row "
        f"(--max-spike-steps {train_cfg.max_spike_steps}); the run began to diverge at "
        f"iteration {spikes.since} ({spikes.why}); nothing was saved since, and {back} with a "
        f"lower --lr, more --lr-warmup-iters or --clip-grad, or check the data")


def spike_kept_from_save(spike: SpikeWatch, iteration: int, saved_at: int | None,
                         save_dir: str) -> str:
    """The line logged instead of saving a spike's state."""
    kept = (f"the checkpoint of iteration {saved_at} stays the latest" if saved_at is not None
            else f"nothing in {save_dir} is replaced")
    return (f"not saving the checkpoint of iteration {iteration}: the run is in a spike that "
            f"began at iteration {spike.since} ({spike.why}); {kept}")


class SpikeWatch:
    """Which steps are loss or gradient-norm spikes, so their state is not saved.

    The rule (Megatron's spiky-loss idea, against a median instead of a maximum so that one
    early high value does not raise the bar): with ``factor`` F (``--spike-factor``, 10) and the
    last ``window`` (``--spike-window``, 50) sound steps, a step is a spike when

    * its loss exceeds F x max(1, median loss): the floor of one nat keeps a run whose loss is
      near zero (a memorised fine-tuning set) from calling an ordinary batch a spike; or
    * after 10 sound steps (or ``window``, if fewer), its gradient norm exceeds F x their
      median gradient norm.

    * its loss is NaN/inf (its update is skipped, and :func:`note_nonfinite` counts it).

    A spike's loss and norm do not enter the history, so an exploded run stays a spike however
    long it lasts. ``since`` is the first iteration of the current spike (None when the last
    step was sound). Every rank sees the same global loss and norm, so every rank decides alike
    without communicating.
    """

    MIN_NORMS = 10

    def __init__(self, factor: float = 10.0, window: int = 50) -> None:
        self.factor, self.window = factor, window
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.since: int | None = None
        self.why = ""

    @staticmethod
    def _median(values: list[float]) -> float:
        s = sorted(values)
        n = len(s)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is a spike, or None (without recording it)."""
        if not self.factor:
            return None
        if not math.isfinite(loss):
            return "the loss is NaN/inf"
        if self.losses:
            bar = self.factor * max(1.0, self._median(self.losses))
            if loss > bar:
                return (f"loss {loss:.4E} is more than {self.factor:g}x the median of the last "
                        f"{len(self.losses)} sound iterations ({self._median(self.losses):.4E})")
        if len(self.norms) >= min(self.MIN_NORMS, self.window) and math.isfinite(grad_norm):
            med = self._median(self.norms)
            if grad_norm > self.factor * med:
                return (f"grad norm {grad_norm:.4E} is more than {self.factor:g}x the median of "
                        f"the last {len(self.norms)} sound iterations ({med:.4E})")
        return None

    def observe(self, iteration: int, loss: float, grad_norm: float) -> bool:
        """Record one step; True when it is a spike."""
        why = self.judge(loss, grad_norm)
        if why is not None:
            if self.since is None:
                self.since, self.why = iteration, why
            return True
        if math.isfinite(loss):
            self.since, self.why = None, ""
            self.losses = (self.losses + [loss])[-self.window:]
            if math.isfinite(grad_norm):
                self.norms = (self.norms + [grad_norm])[-self.window:]
        return False


@dataclass(frozen=True)
class PendingSave:
    """A checkpoint written at ``iteration`` whose weights the next step has yet to judge: its
    loss is computed with them, so a spike there means the update that produced them went
    wrong (a learning rate of 1e6 shows only in the loss after the update)."""

    iteration: int
    tracker_before: str | None  # the tracker's text before this save (None: no tracker)
    saved_before: int | None  # the newest checkpoint before this save


def read_tracker_text(save_dir: str | None) -> str | None:
    if not save_dir:
        return None
    try:
        with open(os.path.join(save_dir, TRACKER), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def discard_checkpoint(save_dir: str, iteration: int, tracker_before: str | None) -> None:
    """Put ``latest`` back to ``tracker_before`` (atomically; removed when there was none),
    then remove the iteration's directory."""
    path = os.path.join(save_dir, TRACKER)
    if tracker_before is None:
        try:
            os.remove(path)
        except OSError:
            pass
    else:
        Writer().text(tracker_before, path)  # atomic: temporary name, fsync, rename
    shutil.rmtree(os.path.join(save_dir, f"iter_{iteration:07d}"), ignore_errors=True)
