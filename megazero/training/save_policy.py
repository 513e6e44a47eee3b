"""When a run saves and loads: the ``--save`` of an interval or of the end, refused while the
state is not worth keeping (a NaN/inf step, a spike, a non-finite weight), a save discarded when
the step after it spikes, and ``--load`` at start-up with what it did not restore.

The checkpoint format itself (what a save writes, how a load reads it at any layout) is
:mod:`megazero.checkpoint`.
"""

from __future__ import annotations

import time
from typing import Any

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.checkpoint.async_save import Outcome
from megazero.checkpoint.save_check import checkpoint_bytes, save_allowed
from megazero.checkpoint.save_ranges import bucket_for
from megazero.errors import CheckpointError
from megazero.training.builders import ChunkTrackers
from megazero.training.divergence import (
    PendingSave,
    discard_checkpoint,
    params_finite,
    spike_kept_from_save,
)
from megazero.training.run import Run

FP8_HISTORY_KEY = "fp8_amax_history"


def fp8_extra_state(run: Run) -> dict[str, Any] | None:
    """Collective: delayed scaling's amax histories, by global tensor name (layout-free), as
    the checkpoint's extra state; None when the run keeps none."""
    if run.fp8 is None or run.fp8.recipe.recipe != "delayed":
        return None
    return {FP8_HISTORY_KEY: run.fp8.gather_state_dict()}


def load_fp8_state(run: Run, extra: Any) -> None:
    """Continue the saved amax histories (at any layout: they are keyed by tensor name)."""
    if run.fp8 is None or run.fp8.recipe.recipe != "delayed":
        return
    saved = extra.get(FP8_HISTORY_KEY) if isinstance(extra, dict) else None
    if saved is None:
        run.monitor.info("note: the checkpoint holds no FP8 amax history; delayed scaling "
                         "starts from an empty one")
        return
    missing = run.fp8.load_state_dict(saved)
    if missing:
        run.monitor.info(f"note: no saved FP8 amax history for {len(missing)} tensors (e.g. "
                         f"{missing[0]}); they start from an empty one")


def save(run: Run, final: bool = False, saved_before: int | None = None) -> None:
    """Save the run's state now: in the background with ``--async-save`` (not ``final``: the
    end of a run writes at once), else synchronously. Either way a save still in flight is
    waited for first: one at a time. ``saved_before``: the newest checkpoint before this one
    (an asynchronous save that is discarded or fails leaves it the latest)."""
    ck = run.cfg.checkpoint
    if not ck.save:
        return
    it = run.state.iteration
    if run.saver is not None and run.saver.busy:  # the loop waits first; never two at once
        settle(run, run.saver.wait(f"the checkpoint of iteration {it}"))
    t0 = time.perf_counter()
    save_allowed(ck.save, run.owner, run.topo, run.env.device)  # still this run's directory
    run_id = run.owner.run_id if run.owner is not None else None
    bucket = bucket_for(checkpoint_bytes(run.engine))
    extra = fp8_extra_state(run)
    if run.saver is not None and not final:
        run.saver.start(ck.save, it, run.topo, models=run.chunks, optimizer=run.engine,
                        scheduler=run.scheduler, consumed_samples=run.state.consumed_samples,
                        config=run.cfg, zero_stage=run.cfg.zero.stage,
                        rng_tracker=ChunkTrackers(run.chunks), run_id=run_id,
                        writer=run.checkpoint_writer, saved_before=saved_before,
                        bucket_bytes=bucket, extra_state=extra)
        return
    # A write that fails (a full disk, a directory gone or made read-only) is a CheckpointError
    # on every rank; a collective that fails (a peer died mid-save) stays the backend's error.
    save_checkpoint(ck.save, run.state.iteration, run.topo, models=run.chunks,
                    optimizer=run.engine, scheduler=run.scheduler,
                    consumed_samples=run.state.consumed_samples, config=run.cfg,
                    zero_stage=run.cfg.zero.stage, rng_tracker=ChunkTrackers(run.chunks),
                    writer=run.checkpoint_writer, run_id=run_id, bucket_bytes=bucket,
                    extra_state=extra)
    run.monitor.info(f"saved checkpoint at iteration {run.state.iteration:7d} to {ck.save} "
                     f"({time.perf_counter() - t0:.2f}s)")


def load(run: Run) -> None:
    ck = run.cfg.checkpoint
    if not ck.load:
        return
    res = load_checkpoint(ck.load, run.topo, models=run.chunks, optimizer=run.engine,
                          scheduler=run.scheduler, zero_stage=run.cfg.zero.stage,
                          rng_tracker=ChunkTrackers(run.chunks), no_load_optim=ck.no_load_optim,
                          no_load_rng=ck.no_load_rng, finetune=ck.finetune, config=run.cfg)
    if res is None:
        run.monitor.info(f"no checkpoint found in {ck.load}; starting from scratch")
        return
    run.state.iteration, run.state.consumed_samples = res.iteration, res.consumed_samples
    if not ck.finetune:
        load_fp8_state(run, res.extra_state)
    if ck.no_load_optim and not ck.finetune:
        run.scheduler.load_state_dict({"num_steps": res.iteration})
    for note in res.notes:
        run.monitor.info(f"note: {note}")
    run.monitor.info(f"loaded checkpoint {res.path} at iteration {res.iteration}")
    if ck.finetune:
        run.monitor.info("> --finetune: weights only; iteration 0, fresh optimizer state and "
                         "learning-rate schedule")
    elif ck.no_load_optim:
        run.monitor.info(f"> --no-load-optim: optimizer state NOT loaded (Adam moments start "
                         f"at zero); the learning-rate schedule continues at iteration "
                         f"{res.iteration}")


def save_if_sound(run: Run, why: str, saved_at: int | None = None) -> bool:
    """Save unless the state is not worth keeping: the last step had a NaN/inf loss or
    gradient (its weights produce garbage), the run is in a loss or grad-norm spike
    (:class:`~megazero.training.divergence.SpikeWatch`), or a weight is NaN/inf. ``latest`` then
    keeps naming the last sound checkpoint."""
    if not run.cfg.checkpoint.save:
        return False
    st = run.state
    if st.spikes.since is not None:  # the same global loss and norm on every rank
        run.monitor.info(spike_kept_from_save(st.spikes, st.iteration, saved_at,
                                              run.cfg.checkpoint.save))
        return False
    run.engine.wait_for_params()  # --overlap-param-gather: the weights are read here
    if st.nonfinite_streak or not params_finite(run.chunks, run.topo, run.env.device):
        run.monitor.info(f"not saving the {why} checkpoint at iteration {st.iteration}: the "
                         f"model's loss, gradients or weights are NaN/inf; the last checkpoint "
                         f"in {run.cfg.checkpoint.save} stays the latest")
        return False
    save(run, final=why == "final", saved_before=saved_at)
    return True


def settle(run: Run, outcomes: list[Outcome], saved_at: int | None = None) -> int | None:
    """Asynchronous saves that ended (every rank learns them alike): one that was discarded or
    failed leaves the checkpoint before it the newest; returns ``saved_at`` updated. A failed
    one stops the run with ``--exit-on-save-failure`` (a CheckpointError on every rank)."""
    for out in outcomes:
        if out.committed:
            continue
        if saved_at == out.iteration:
            saved_at = out.saved_before
        if not out.discarded and run.cfg.checkpoint.exit_on_save_failure:
            raise CheckpointError(
                f"the asynchronous save of iteration {out.iteration} failed ({out.why}); "
                f"stopping as --exit-on-save-failure says. The checkpoint of iteration "
                f"{out.saved_before} stays the latest: resume from it with --load "
                f"{run.cfg.checkpoint.save}")
    return saved_at


def discard_save(run: Run, pending: PendingSave, saved_at: int | None) -> int | None:
    """The step after a save spiked: the weights that save holds came out of the update that
    caused it. Rank 0 puts ``latest`` back and removes the save; returns the newest sound
    checkpoint."""
    save_dir = run.cfg.checkpoint.save
    assert save_dir
    if run.topo.rank == 0:
        discard_checkpoint(save_dir, pending.iteration, pending.tracker_before)
    kept = (f"the checkpoint of iteration {pending.saved_before} is the latest again"
            if pending.saved_before is not None else "no checkpoint of this run is kept")
    run.monitor.info(f"discarded the checkpoint of iteration {pending.iteration}: the step "
                     f"after it is a spike ({run.state.spikes.why}), so the update it saved "
                     f"is suspect; {kept}")
    return pending.saved_before
