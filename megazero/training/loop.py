"""The training loop: pipeline schedule -> gradient sync -> optimizer step -> schedule -> log ->
evaluate -> checkpoint, until ``--train-iters`` or an exit condition (one iteration is
:func:`megazero.training.step.train_step`).

Exit conditions (``--exit-interval``, ``--exit-duration-in-mins``, SIGTERM) are agreed by every
rank (:mod:`megazero.training.exit_conditions`). A NaN/inf step is skipped and a diverged run
stops without saving (:mod:`megazero.training.divergence`); a stuck or orphaned rank is ended by
the watchdog (:mod:`megazero.training.watchdog`), which the loop tells what it is doing through
:meth:`Run.phase`.
"""

from __future__ import annotations

import gc
import math
import time
from typing import cast

import torch
import torch.distributed as dist

from megazero.checkpoint.ownership import HEARTBEAT_S, heartbeat
from megazero.observability.flops import gpt_flops_per_iteration, peak_flops
from megazero.observability.flops_profiler import for_run as flops_profiler_for
from megazero.observability.optimizer_states import optimizer_state_stats
from megazero.observability.profiling import StepProfiler
from megazero.optim.onebit import exchange_scalars
from megazero.training.builders import batch_iterator
from megazero.training.divergence import (
    PendingSave,
    note_nonfinite,
    note_spikes,
    read_tracker_text,
)
from megazero.training.exit_conditions import ExitFlags, exit_decision, exit_votes
from megazero.training.run import Run, TrainState
from megazero.training.save_policy import discard_save, save_if_sound, settle
from megazero.training.step import evaluate, fp8_metrics, moe_metrics, train_step


def train(run: Run) -> TrainState:
    cfg, st, b = run.cfg, run.state, run.batching
    log_interval = run.monitor.config.log_interval
    vocab = cast(int, run.chunks[0].padded_vocab_size)
    peak = None
    if run.env.device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(run.env.device),
                          cfg.precision.fp16 or cfg.precision.bf16)
    if _complete(run):
        return st
    data_iter = batch_iterator(run.train_ds, b, run.topo, st.consumed_samples)
    flags = ExitFlags()
    flags.install()
    # --manual-gc (Megatron): a collection pauses one rank at an arbitrary point and every other
    # rank waits for it at the next collective; collecting every N iterations on all ranks at
    # once turns those stalls into one known pause.
    gc_every = cfg.train.manual_gc_interval if cfg.train.manual_gc else 0
    if cfg.train.manual_gc:
        gc.disable()
        gc.collect()
    profiler = StepProfiler(cfg.logging, dist.get_rank() if dist.is_initialized() else 0,
                            run.env.device)
    if (note := profiler.note()) is not None:
        print(f"note: {note}", flush=True)
    # the profiled iteration's model FLOPs: ``gbs`` is read when the report is made
    flops_profiler = flops_profiler_for(
        run, lambda: gpt_flops_per_iteration(cfg.model, gbs, vocab))
    start = time.time()
    saved_at = st.iteration if cfg.checkpoint.load else None
    pending: PendingSave | None = None
    run.timers.pop_all()
    run.timers.pop_overlapped()
    run.monitor.start_interval()
    try:
        while st.iteration < b.train_iters and not b.tokens_done(st.consumed_samples):
            t0 = time.perf_counter()
            gbs = b.global_batch_at(st.consumed_samples)  # a ramp-up grows it with the samples
            profiler.before(st.iteration + 1)
            flops_profiler.before(st.iteration + 1)
            if run.stragglers is not None:
                run.stragglers.iteration_started()
            loss, result, votes = train_step(
                run, data_iter, lambda: exit_votes(cfg.train, flags, start) + (
                    run.saver.votes() if run.saver is not None else []))
            st.iteration += 1
            st.consumed_samples += gbs
            if run.stragglers is not None:
                run.stragglers.iteration_done(time.perf_counter() - t0)
            empty_unused_memory(cfg.train.empty_unused_memory_level, 1, run.env.device)
            for table in (profiler.after(st.iteration), flops_profiler.after(st.iteration)):
                if table is not None:
                    print(table, flush=True)
            t = run.timers
            with t.region("logging"):
                phases = t.pop_all() if st.iteration % log_interval == 0 else None
                run.monitor.record(loss, result.skipped, time.perf_counter() - t0, phases,
                                   nonfinite=result.nonfinite)
                st.history.append({"iteration": st.iteration, "loss": loss,
                                   "grad_norm": result.grad_norm,
                                   "loss_scale": result.loss_scale,
                                   "skipped": float(result.skipped),
                                   **({"num_zeros": result.num_zeros}
                                      if result.num_zeros is not None else {})})
                if st.iteration % log_interval == 0:
                    norm = None if result.skipped or math.isnan(result.grad_norm) else (
                        result.grad_norm)
                    # 1-bit optimizers: the bytes the step's compressed exchange sent
                    run.monitor.memory_phases.update(exchange_scalars(run.engine))
                    moe = moe_metrics(run, log_interval)
                    fp8 = fp8_metrics(run)
                    if cfg.logging.log_optimizer_states_to_tensorboard:  # collective
                        run.monitor.memory_phases.update(optimizer_state_stats(run.engine,
                                                                               run.topo))
                    run.monitor.report(st.iteration, b.train_iters, st.consumed_samples,
                                       run.scheduler.get_lr(), gbs,
                                       cfg.model.seq_length, result.loss_scale, norm,
                                       gpt_flops_per_iteration(cfg.model, gbs, vocab),
                                       run.topo.world_size, peak,
                                       overlapped=t.pop_overlapped(),
                                       num_zeros=result.num_zeros, moe=moe, fp8=fp8)
                    if run.stragglers is not None:
                        run.stragglers.report()
            spiked = st.spikes.observe(st.iteration, loss, result.grad_norm)
            if pending is not None:  # the step after a save judges the weights it saved
                if spiked and run.saver is not None and run.saver.busy:
                    saved_at = run.saver.discard(f"the step after it is a spike "
                                                 f"({st.spikes.why}), so the update it saved "
                                                 "is suspect")
                elif spiked:
                    saved_at = discard_save(run, pending, saved_at)
                pending = None
            if run.saver is not None:  # an asynchronous save: ended everywhere, or not yet
                if spiked and run.saver.busy:
                    saved_at = run.saver.discard(f"a spike while it was written "
                                                 f"({st.spikes.why})")
                saved_at = settle(run, run.saver.settle(votes[2:]), saved_at)
            note_nonfinite(st, cfg.train, result.nonfinite, loss, saved_at, cfg.checkpoint.save,
                           st.spikes)
            note_spikes(st, cfg.train, spiked, saved_at, cfg.checkpoint.save)
            if run.owner is not None and cfg.checkpoint.save:
                heartbeat(cfg.checkpoint.save, every_s=HEARTBEAT_S)
            if gc_every and st.iteration % gc_every == 0:
                gc.collect()
            if cfg.train.eval_interval and st.iteration % cfg.train.eval_interval == 0:
                with t.region("evaluation"), t.paused(), run.phase(
                        f"evaluation at iteration {st.iteration}", "mp"):
                    if cfg.train.manual_gc and cfg.train.manual_gc_eval:
                        gc.collect()
                    val = evaluate(run)
                    empty_unused_memory(cfg.train.empty_unused_memory_level, 2, run.env.device)
                    if cfg.train.manual_gc and cfg.train.manual_gc_eval:
                        gc.collect()
                if val is not None:
                    run.monitor.report_validation(st.iteration, val,
                                                  consumed_samples=st.consumed_samples)
            if (cfg.checkpoint.save_interval
                    and st.iteration % cfg.checkpoint.save_interval == 0):
                with t.region("checkpoint save"), t.paused(), run.phase(
                        f"checkpoint save at iteration {st.iteration}", "world"):
                    if run.saver is not None and run.saver.busy:  # one save at a time
                        saved_at = settle(run, run.saver.wait(
                            f"the checkpoint of iteration {st.iteration}"), saved_at)
                    before = read_tracker_text(cfg.checkpoint.save)
                    if save_if_sound(run, "interval", saved_at):
                        pending = PendingSave(st.iteration, before, saved_at)
                        saved_at = st.iteration
            stop, why = exit_decision(cfg.train, st.iteration, votes)
            if stop:
                run.monitor.info(f"exiting at iteration {st.iteration}: {why}")
                st.exit_reason = why
                break
    finally:
        flags.uninstall()
        if cfg.train.manual_gc:
            gc.enable()
    if st.exit_reason is None and b.tokens_done(st.consumed_samples):
        run.monitor.info(f"reached --train-tokens {b.train_tokens:,} at iteration "
                         f"{st.iteration} ({st.consumed_samples * b.seq_length:,} tokens)")
    if run.saver is not None:
        with run.phase(f"waiting for the checkpoint in flight at iteration {st.iteration}",
                       "world"):
            saved_at = settle(run, run.saver.wait(
                st.exit_reason or "the end of training"), saved_at)
    if saved_at != st.iteration:
        with run.phase(f"final checkpoint save at iteration {st.iteration}", "world"):
            save_if_sound(run, "final", saved_at)
    return st


def _complete(run: Run) -> bool:
    """A resumed run that has nothing left to train says so (and is marked as having exited,
    so no evaluation or save follows): its checkpoint already reached --train-iters (or
    --train-samples, --train-tokens)."""
    st, b = run.state, run.batching
    if st.iteration < b.train_iters and not b.tokens_done(st.consumed_samples):
        return False
    what = (f"--train-tokens {b.train_tokens:,} ({st.consumed_samples * b.seq_length:,} tokens "
            "consumed)" if b.tokens_done(st.consumed_samples) else f"the {b.train_iters} "
            "iterations to train (--train-iters or --train-samples)")
    st.exit_reason = "already complete"
    run.monitor.info(f"nothing to train: the checkpoint loaded from {run.cfg.checkpoint.load} "
                     f"is at iteration {st.iteration}, which already reached {what}; the run "
                     "is complete (raise --train-iters to train further)")
    return True


def empty_unused_memory(level: int, needs: int, device: torch.device) -> None:
    """Megatron's ``--empty-unused-memory-level``: return the CUDA caching allocator's unused
    blocks to the driver after each iteration (level 1) and each evaluation too (level 2), at
    the price of allocating them again. A CPU run has no such cache."""
    if level >= needs and device.type == "cuda":
        torch.cuda.empty_cache()
