"""The training loop: pipeline schedule -> gradient sync -> optimizer step -> schedule -> log ->
evaluate -> checkpoint, until ``--train-iters`` or an exit condition.

One iteration on every rank::

    losses = forward_backward(chunks, train_iter, topo, m, ...)   # m micro-batches, 1F1B
    engine.finish_grad_sync()      # dp reduce (-scatter), TP-SP and tied-embedding sums
    result = engine.step()         # overflow check, grad norm + clip, AdamW on the shard
    scheduler.step()               # only after an update, as Megatron and DeepSpeed do

The reported ``lm loss`` is the mean of the per-micro-batch token means over all micro-batches
and data-parallel ranks, the same number a one-process run on the whole global batch computes.
Rank 0 reports (the pipeline executor returns the losses on every pipeline rank).

Exit conditions (``--exit-interval``, ``--exit-duration-in-mins``, SIGTERM) are agreed by every
rank (:mod:`megazero.exit_conditions`). A NaN/inf step is skipped and a diverged run stops without
saving (:mod:`megazero.divergence`); a stuck or orphaned rank is ended by the watchdog
(:mod:`megazero.watchdog`), which the loop tells what it is doing through :meth:`Run.phase`.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megazero.banner import describe_run
from megazero.checkpoint.ownership import (
    HEARTBEAT_S,
    RunOwner,
    heartbeat,
    new_run_id,
    release,
)
from megazero.checkpointing import config_dict, load_checkpoint, save_checkpoint
from megazero.comms_logging import CommsLogger, CommsLoggerSettings
from megazero.config import ConfigError, MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.dist_init import (
    DistEnv,
    enable_deterministic_mode,
    free_destroyed_groups,
    initialize_distributed,
    set_seed,
)
from megazero.divergence import (
    PendingSave,
    SpikeWatch,
    TrainingDivergedError,
    discard_checkpoint,
    note_nonfinite,
    params_finite,
    read_tracker_text,
    spike_kept_from_save,
)
from megazero.errors import claim_report, expected_errors
from megazero.exit_conditions import ExitFlags, exit_decision, exit_votes, sigterm_deferred
from megazero.flops import gpt_flops_per_iteration, peak_flops
from megazero.flops_profiler import for_run as flops_profiler_for
from megazero.lr_scheduler import LRScheduler, build_lr_function
from megazero.monitor import Monitor, Timers
from megazero.optim.onebit import exchange_scalars
from megazero.peers import PeerRegistry
from megazero.pipeline.activation_meter import ActivationMeter
from megazero.profiling import StepProfiler
from megazero.resume_checks import check_resume
from megazero.save_check import check_save_dir, checkpoint_bytes, claim_save_dir, save_allowed
from megazero.topology import GROUP_KINDS, ParallelTopology
from megazero.train_setup import (
    Batching,
    ChunkTrackers,
    batch_iterator,
    build_datasets,
    build_model_and_optimizer,
    build_tokenizer_and_data_path,
    get_batch,
)
from megazero.watchdog import WATCHDOG_EXIT_CODE, Watchdog

if TYPE_CHECKING:
    from megazero.zero.optimizer import ZeroOptimizer

#: Iterations kept in :attr:`TrainState.history`: enough for tests and a post-mortem of the
#: last steps, bounded so a million-iteration run does not grow a million dicts.
HISTORY_LENGTH = 1000


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    exit_reason: str | None = None  # set when training stopped before --train-iters
    # The last HISTORY_LENGTH iterations' loss, grad norm, loss scale, skipped flag.
    history: deque[dict[str, float]] = field(
        default_factory=lambda: deque(maxlen=HISTORY_LENGTH))
    nonfinite_streak: int = 0  # NaN/inf steps in a row, reset by a finite one
    spikes: SpikeWatch = field(default_factory=SpikeWatch)  # steps not worth saving


@dataclass
class Run:
    """Everything one training run holds."""

    cfg: MegazeroConfig
    env: DistEnv
    topo: ParallelTopology
    batching: Batching
    chunks: list[torch.nn.Module]
    engine: ZeroOptimizer
    scheduler: LRScheduler
    monitor: Monitor
    timers: Timers
    train_ds: Any
    valid_ds: Any
    state: TrainState
    watchdog: Watchdog | None = None
    checkpoint_writer: Any = None  # a megazero.checkpoint.files.Writer; None = the default
    owner: RunOwner | None = None  # rank 0: the run holding the --save directory's lock
    eod_mask: int | None = None  # --eod-mask-loss: the end-of-document id whose next is masked
    comms_logger: CommsLogger | None = None  # DeepSpeed's "comms_logger", while installed

    def close(self) -> None:
        """Put torch.distributed's collectives back, close the log sinks, and give the
        ``--save`` directory's lock back."""
        if self.comms_logger is not None:
            self.comms_logger.uninstall()
        self.monitor.close()
        if self.owner is not None and self.cfg.checkpoint.save:
            release(self.cfg.checkpoint.save, self.owner)
            self.owner = None

    @property
    def sp(self) -> bool:
        return sequence_parallel_active(self.cfg.parallel.sequence_parallel, self.topo.tp_size)

    def phase(self, what: str, group: str | None = None) -> AbstractContextManager[None]:
        """Mark what this rank is doing for the watchdog (``group``: the process group the
        phase waits on, named as in :mod:`megazero.topology`)."""
        if self.watchdog is None:
            return nullcontext()
        ranks = (self.topo.ranks(group) if group in GROUP_KINDS
                 else range(self.topo.world_size))
        return self.watchdog.phase(what, group, ranks)


def _schedule(run: Run, data_iter, forward_only: bool,
              activation_meter: ActivationMeter | None = None,
              num_microbatches: int | None = None) -> list[float]:
    """One pass of the pipeline schedule over ``num_microbatches`` micro-batches (default: a
    full global batch's); returns their mean losses."""
    from megazero.pipeline.executor import default_loss_fn, forward_backward

    scale = run.engine.loss_scale if (run.cfg.precision.fp16 and not forward_only) else 1.0

    def loss_fn(per_token: torch.Tensor, batch: dict) -> torch.Tensor:
        # fp16: the executor back-propagates what this returns, so the loss scale goes here;
        # the scale is a power of two, so dividing the reported loss by it below is exact.
        if run.topo.cp_size > 1:  # the micro-batch's tokens are split over the CP group
            from megazero.context_parallel.loss import exact_mean_loss

            return exact_mean_loss(per_token, batch.get("loss_mask"), run.topo.cp_group) * scale
        return default_loss_fn(per_token, batch) * scale

    m = run.cfg.model
    count = num_microbatches or run.batching.num_microbatches
    if m.moe.enabled:  # MoE auxiliary losses are scaled as each micro-batch's loss is
        from megazero.moe.moe_utils import set_aux_loss_scale

        set_aux_loss_scale(scale / count)
    losses = forward_backward(
        run.chunks, data_iter, run.topo,
        num_microbatches or run.batching.num_microbatches, m.seq_length // run.topo.cp_size,
        run.batching.micro_batch_size, m.hidden_size, forward_only=forward_only,
        sequence_parallel=run.sp, dtype=run.cfg.precision.params_dtype, loss_fn=loss_fn,
        get_batch=_timed_get_batch(run),
        grad_sync=None if forward_only else run.engine, activation_meter=activation_meter,
        microbatch_group_size=run.cfg.parallel.microbatch_group_size_per_vp_stage)
    return [x / scale for x in losses]


def _moe_metrics(run: Run, iterations: int) -> dict[str, float] | None:
    """The routers' scalars of the log interval (collective: every rank calls it)."""
    moe = run.cfg.model.moe
    if not moe.enabled:
        return None
    from megazero.moe.metrics import collect

    assert moe.num_experts is not None
    return collect(run.chunks, run.topo, run.cfg.model.num_layers, moe.num_experts, iterations,
                   moe.moe_per_layer_logging)


def _timed_get_batch(run: Run):
    fetch = functools.partial(get_batch, device=run.env.device, eod_mask=run.eod_mask,
                              cp=(run.topo.cp_rank, run.topo.cp_size))
    if not run.timers.enabled:
        return fetch

    def timed(data_iterator):
        with run.timers.region("data"):
            return fetch(data_iterator)

    return timed


def _dp_mean(values: list[float], topo: ParallelTopology, device: torch.device) -> float:
    t = torch.tensor([sum(values), float(len(values))], dtype=torch.float64, device=device)
    if topo.dp_size > 1:
        dist.all_reduce(t, group=topo.dp_group)
    return (t[0] / t[1]).item()


def train_step(run: Run, data_iter, exit_votes: Callable[[], list[float]] = lambda: []
               ) -> tuple[float, Any, list[float]]:
    """One iteration; returns (global mean loss, StepResult, this rank's ``exit_votes()``
    (taken before the update) summed over every rank). The loss and the votes ride in the
    optimizer step's one scalar all-reduce: besides gradient and parameter traffic an
    iteration makes a single blocking collective. Its ``wall_clock_breakdown`` regions stay
    in ``run.timers`` until the loop reads them at a logged iteration (on GPUs resolving
    their events is a wait for the device: once per log line, not per iteration)."""
    t, it = run.timers, run.state.iteration + 1
    mem = None
    if run.cfg.logging.log_memory_phases:
        from megazero.planner.memory_phases import MemoryPhases

        mem = MemoryPhases(run.engine, run.env.device)
    with t.region("backward"), run.phase(f"iteration {it}: forward-backward (pipeline "
                                         "schedule)", "mp"):
        losses = _schedule(run, data_iter, forward_only=False,
                           activation_meter=mem.meter if mem is not None else None,
                           num_microbatches=run.batching.microbatches_at(
                               run.state.consumed_samples))
    with t.region("grad sync (local)"), run.phase(f"iteration {it}: gradient sync", "dp"):
        run.engine.finish_grad_sync()
    if mem is not None:
        mem.after_backward()
    finite = all(math.isfinite(x) for x in losses)
    own = _loss_sums(losses, run.topo)
    votes = exit_votes()
    with t.region("optimizer"), run.phase(f"iteration {it}: optimizer step (non-finite "
                                          "check, grad norm, loss and exit votes)", "world"):
        result = run.engine.step(loss_is_finite=finite,
                                 skip_nonfinite=run.cfg.train.check_for_nan_in_loss_and_grad,
                                 also_sum=[*own, *votes])
    if mem is not None:
        run.monitor.record_memory(mem.after_step())
    with t.region("scheduler"):
        if result.updated:
            run.scheduler.step()
    if run.cfg.model.moe.enabled:
        from megazero.moe.router import update_expert_biases

        update_expert_biases(run.chunks, run.topo, apply=result.updated)
    loss_sum, count, *summed_votes = result.sums
    return loss_sum / count, result, summed_votes


def _loss_sums(losses: list[float], topo: ParallelTopology) -> tuple[float, float]:
    """This rank's part of the global mean loss: (sum, count) of its micro-batch losses. Every
    tp x pp rank of a data-parallel replica holds the replica's losses (the executor hands them
    to every pipeline stage), so only its tp 0, pp 0 rank counts them. They are summed over
    every rank inside the optimizer step's scalar all-reduce, with the exit votes."""
    owner = topo.tp_rank == 0 and topo.pp_rank == 0 and topo.cp_rank == 0
    return (sum(losses), float(len(losses))) if owner else (0.0, 0.0)


def _time_forwards(chunks: list[torch.nn.Module], timers: Timers) -> None:
    for c in chunks:
        c.register_forward_pre_hook(lambda *_: timers.start("forward"))
        c.register_forward_hook(lambda *_: timers.stop("forward"))


def evaluate(run: Run) -> float | None:
    """Mean validation loss over ``--eval-iters`` global batches, forward only. The validation
    iterator restarts at its first sample each time, so evaluations are comparable."""
    if run.valid_ds is None or run.cfg.train.eval_iters <= 0:
        return None
    for c in run.chunks:
        c.eval()
    it = batch_iterator(run.valid_ds, run.batching, run.topo, 0, cyclic=True)
    losses: list[float] = []
    with torch.no_grad():
        for _ in range(run.cfg.train.eval_iters):
            losses += _schedule(run, it, forward_only=True)
    for c in run.chunks:
        c.train()
    return _dp_mean(losses, run.topo, run.env.device)


def _save(run: Run) -> None:
    ck = run.cfg.checkpoint
    if not ck.save:
        return
    t0 = time.perf_counter()
    save_allowed(ck.save, run.owner, run.topo, run.env.device)  # still this run's directory
    # A write that fails (a full disk, a directory gone or made read-only) is a CheckpointError
    # on every rank; a collective that fails (a peer died mid-save) stays the backend's error.
    save_checkpoint(ck.save, run.state.iteration, run.topo, models=run.chunks,
                    optimizer=run.engine, scheduler=run.scheduler,
                    consumed_samples=run.state.consumed_samples, config=run.cfg,
                    zero_stage=run.cfg.zero.stage, rng_tracker=ChunkTrackers(run.chunks),
                    writer=run.checkpoint_writer,
                    run_id=run.owner.run_id if run.owner is not None else None)
    run.monitor.info(f"saved checkpoint at iteration {run.state.iteration:7d} to {ck.save} "
                     f"({time.perf_counter() - t0:.2f}s)")


def _load(run: Run) -> None:
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


def _save_if_sound(run: Run, why: str, saved_at: int | None = None) -> bool:
    """Save unless the state is not worth keeping: the last step had a NaN/inf loss or
    gradient (its weights produce garbage), the run is in a loss or grad-norm spike
    (:class:`~megazero.divergence.SpikeWatch`), or a weight is NaN/inf. ``latest`` then keeps
    naming the last sound checkpoint."""
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
    _save(run)
    return True


def _discard_save(run: Run, pending: PendingSave, saved_at: int | None) -> int | None:
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


def train(run: Run) -> TrainState:
    cfg, st, b = run.cfg, run.state, run.batching
    log_interval = run.monitor.config.log_interval
    vocab = run.chunks[0].padded_vocab_size
    peak = None
    if run.env.device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(run.env.device),
                          cfg.precision.fp16 or cfg.precision.bf16)
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
        while st.iteration < b.train_iters:
            t0 = time.perf_counter()
            gbs = b.global_batch_at(st.consumed_samples)  # a ramp-up grows it with the samples
            profiler.before(st.iteration + 1)
            flops_profiler.before(st.iteration + 1)
            loss, result, votes = train_step(
                run, data_iter, lambda: exit_votes(cfg.train, flags, start))
            st.iteration += 1
            st.consumed_samples += gbs
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
                    moe = _moe_metrics(run, log_interval)
                    run.monitor.report(st.iteration, b.train_iters, st.consumed_samples,
                                       run.scheduler.get_lr(), gbs,
                                       cfg.model.seq_length, result.loss_scale, norm,
                                       gpt_flops_per_iteration(cfg.model, gbs, vocab),
                                       run.topo.world_size, peak,
                                       overlapped=t.pop_overlapped(),
                                       num_zeros=result.num_zeros, moe=moe)
            spiked = st.spikes.observe(st.iteration, loss, result.grad_norm)
            if pending is not None:  # the step after a save judges the weights it saved
                if spiked:
                    saved_at = _discard_save(run, pending, saved_at)
                pending = None
            note_nonfinite(st, cfg.train, result.nonfinite, loss, saved_at, cfg.checkpoint.save,
                           st.spikes)
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
                    if cfg.train.manual_gc and cfg.train.manual_gc_eval:
                        gc.collect()
                if val is not None:
                    run.monitor.report_validation(st.iteration, val)
            if (cfg.checkpoint.save_interval
                    and st.iteration % cfg.checkpoint.save_interval == 0):
                with t.region("checkpoint save"), t.paused(), run.phase(
                        f"checkpoint save at iteration {st.iteration}", "world"):
                    before = read_tracker_text(cfg.checkpoint.save)
                    if _save_if_sound(run, "interval", saved_at):
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
    if saved_at != st.iteration:
        with run.phase(f"final checkpoint save at iteration {st.iteration}", "world"):
            _save_if_sound(run, "final", saved_at)
    return st


def setup(cfg: MegazeroConfig, log_json: str | None = None) -> Run:
    """Initialise the process group and build everything the loop needs."""
    cfg = check_resume(cfg)  # before the process group: every rank reads the same files
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    env = initialize_distributed(cfg.parallel.distributed_backend,
                                 cfg.parallel.distributed_timeout_minutes)
    peers = PeerRegistry(dist.distributed_c10d._get_default_store(), env.rank,
                         env.world_size).register()
    watchdog = Watchdog(timeout.total_seconds(), env.rank, diagnose=peers.diagnose).start()
    topo = ParallelTopology.build(tp=cfg.parallel.tp, pp=cfg.parallel.pp, vpp=cfg.vpp,
                                  timeout=timeout, cp=cfg.parallel.cp,
                                  ep=cfg.parallel.expert_model_parallel_size,
                                  etp=cfg.parallel.expert_tensor_parallel_size,
                                  expert_groups=cfg.model.moe.enabled)
    set_seed(cfg.train.seed, topo.pp_rank)
    if cfg.train.deterministic_mode:
        enable_deterministic_mode()
    is_reporter = topo.rank == 0
    log = print if is_reporter else (lambda *a, **k: None)
    demo = not cfg.data.data_path and not cfg.data.mock_data
    tokenizer, cfg = build_tokenizer_and_data_path(cfg, topo, log=log)
    if demo:
        log(f"> no --data-path: training on the built-in demo corpus, cached in "
            f"{os.path.dirname(cfg.data.data_path[0])} (--data-cache-path moves it)")
    batching = Batching.from_config(cfg, topo.dp_size)
    train_ds, valid_ds = build_datasets(cfg, batching)
    chunks, engine = build_model_and_optimizer(cfg, topo, env.device)
    scheduler = LRScheduler(engine, build_lr_function(cfg.optimizer, batching.train_iters))
    logging = cfg.logging
    monitor = Monitor(logging, enabled=is_reporter, log_json=log_json or logging.log_json,
                      run_config=config_dict(cfg) if is_reporter else None)
    timers = Timers(enabled=logging.wall_clock_breakdown, device=env.device)
    if timers.enabled:
        _time_forwards(chunks, timers)
        engine.comms.set_timers(timers)
    run = Run(cfg, env, topo, batching, chunks, engine, scheduler, monitor, timers, train_ds,
              valid_ds, TrainState(), watchdog)
    describe_run(run)
    comms = CommsLoggerSettings.from_block(logging.comms_logger)
    if comms.enabled:
        run.comms_logger = CommsLogger(comms, log=monitor.info if is_reporter else None).install()
    run.state.spikes = SpikeWatch(cfg.train.spike_factor, cfg.train.spike_window)
    if cfg.data.eod_mask_loss:
        run.eod_mask = _eod_id(tokenizer)
    engine.count_zeros_in_grad = cfg.logging.log_num_zeros_in_grad
    if cfg.checkpoint.save:
        run.owner = RunOwner.this_process(new_run_id()) if topo.rank == 0 else None
        for line in claim_save_dir(cfg.checkpoint.save, run.owner, topo, env.device):
            run.monitor.info(line)
    check_save_dir(cfg.checkpoint.save, checkpoint_bytes(engine), topo, env.device)
    _load(run)
    return run


def _eod_id(tokenizer: Any) -> int:
    eod = getattr(tokenizer, "eod", None)
    if eod is None:
        raise ConfigError(f"--eod-mask-loss: the tokenizer ({type(tokenizer).__name__}) has no "
                          f"end-of-document token; drop the flag or use a tokenizer with one")
    return int(eod)


def pretrain(cfg: MegazeroConfig, log_json: str | None = None) -> TrainState:
    """Set up, train, evaluate once more at the end, close the sinks, leave the process group.

    The orderly exit (every rank finished, or every rank agreed the run diverged) ends with a
    barrier and then ``destroy_process_group``: no rank tears down its connections while a peer
    still talks to it (gloo aborts such a peer with "terminate called without an active
    exception"). Any other error skips the barrier, since its peers may never reach it; the
    entry point destroys the group and the watchdog ends a peer left waiting.
    """
    run = setup(cfg, log_json)
    diverged: TrainingDivergedError | None = None
    try:
        state = _train_or_explain(run)
        # An early exit (pre-emption, time limit) leaves right after its checkpoint.
        if state.exit_reason is None and cfg.train.eval_iters > 0 and (
                not cfg.train.eval_interval or state.iteration % cfg.train.eval_interval):
            with run.phase(f"final evaluation at iteration {state.iteration}", "mp"):
                val = evaluate(run)
            if val is not None:
                run.monitor.report_validation(state.iteration, val)
        if run.comms_logger is not None:
            run.comms_logger.uninstall()
            run.monitor.info("communication summary (rank 0, from the end of setup to the end "
                             f"of training):\n{run.comms_logger.summary()}")
    except TrainingDivergedError as e:  # every rank raised it: the exit is orderly
        diverged = e
        traceback.clear_frames(e.__traceback__)  # the frames the error passed hold the run
    finally:
        run.close()
    shutdown(run)
    del run
    free_destroyed_groups()
    if diverged is not None:
        raise diverged
    return state


def _train_or_explain(run: Run) -> TrainState:
    """:func:`train`; a collective that fails inside a watched phase (the backend's timeout,
    a peer that closed its connection) ends this rank with one line naming the phase and the
    group instead of a traceback. The group is broken then: nothing is torn down in order.
    Of the ranks that see the failure (every survivor, and the ranks that then see a survivor
    leave), the first to claim the job's error slot speaks; the others exit quietly. The
    launcher's SIGTERM, sent as soon as a peer died, waits until that line is out."""
    with sigterm_deferred():
        try:
            return train(run)
        except RuntimeError as e:
            if isinstance(e, expected_errors()):  # agreed by every rank (a write error)
                raise
            reason = run.watchdog.failure_message(e) if run.watchdog is not None else None
            if reason is None:
                raise
            run.watchdog.stop()  # one message: not the watchdog's as well
            if run.watchdog.take_voice() and claim_report(run.env.rank, unsure=True):
                print(reason, file=sys.stderr, flush=True)
            run.monitor.close()
            os._exit(WATCHDOG_EXIT_CODE)


def shutdown(run: Run) -> None:
    """Barrier, then destroy the process group, then stop the watchdog (see :func:`pretrain`)."""
    run.engine.wait_for_params()  # a last step's overlapped all-gathers: nothing in flight
    if dist.is_initialized():
        with run.phase("shutdown barrier", "world"):
            if run.topo.world_size > 1:
                dist.barrier()
            dist.destroy_process_group()
    if run.watchdog is not None:
        run.watchdog.stop()
