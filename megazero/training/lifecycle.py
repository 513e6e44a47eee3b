"""A run's start and end: :func:`setup` initialises the process group and builds everything the
loop needs (then loads ``--load``); :func:`shutdown` leaves the process group in order.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megazero.checkpoint import config_dict
from megazero.checkpoint.async_save import AsyncSaver
from megazero.checkpoint.ownership import RunOwner, new_run_id
from megazero.checkpoint.save_check import (
    check_save_dir,
    check_staging,
    checkpoint_bytes,
    claim_save_dir,
)
from megazero.config import ConfigError, MegazeroConfig
from megazero.config.observability_schema import CommsLoggerSettings
from megazero.distributed.peers import PeerRegistry
from megazero.distributed.startup import enable_deterministic_mode, initialize_distributed, set_seed
from megazero.distributed.topology import ParallelTopology
from megazero.errors import attempt_key
from megazero.observability.comms_logging import CommsLogger
from megazero.observability.monitor import Monitor, Timers
from megazero.observability.stragglers import StragglerSettings, StragglerWatch
from megazero.optim.lr_scheduler import LRScheduler, build_lr_function, decoupled_schedule
from megazero.training.banner import describe_run
from megazero.training.builders import (
    Batching,
    build_datasets,
    build_fp8,
    build_model_and_optimizer,
    build_tokenizer_and_data_path,
    gather_fp8_params,
)
from megazero.training.divergence import SpikeWatch
from megazero.training.healing import keep_global_batch, resume_after_restart
from megazero.training.resume_checks import check_resume, saved_config, saved_progress
from megazero.training.run import Run, TrainState
from megazero.training.save_policy import load
from megazero.training.watchdog import Watchdog


def time_forwards(chunks: list[torch.nn.Module], timers: Timers) -> None:
    for c in chunks:
        c.register_forward_pre_hook(lambda *_: timers.start("forward"))
        c.register_forward_hook(lambda *_: timers.stop("forward"))


def setup(cfg: MegazeroConfig, log_json: str | None = None) -> Run:
    """Initialise the process group and build everything the loop needs."""
    cfg, notes = resume_after_restart(cfg)  # torchrun --max-restarts: resume from --save
    cfg = check_resume(cfg)  # before the process group: every rank reads the same files
    cfg, batch_note = keep_global_batch(
        cfg, saved_config(cfg.checkpoint.load) if cfg.checkpoint.load else None)
    notes += [batch_note] if batch_note else []
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
    train_ds, valid_ds = build_datasets(cfg, batching, saved_progress(cfg.checkpoint.load))
    chunks, engine = build_model_and_optimizer(cfg, topo, env.device)
    schedule = build_lr_function(cfg.optimizer, batching.train_iters, batching.tokens_at)
    scheduler = LRScheduler(engine, schedule,
                            decoupled=decoupled_schedule(cfg.optimizer, schedule))
    logging = cfg.logging
    monitor = Monitor(logging, enabled=is_reporter, log_json=log_json or logging.log_json,
                      run_config=config_dict(cfg) if is_reporter else None)
    timers = Timers(enabled=logging.timed, device=env.device)
    if timers.enabled:
        time_forwards(chunks, timers)
        engine.comms.set_timers(timers)
    run = Run(cfg, env, topo, batching, chunks, engine, scheduler, monitor, timers, train_ds,
              valid_ds, TrainState(), watchdog)
    run.fp8 = build_fp8(cfg, topo, chunks, env.device)
    if run.fp8 is not None and cfg.precision.fp8_param_gather:
        units = gather_fp8_params(run.fp8, engine)
        if cfg.zero.stage == 3:
            notes.append(f"> --fp8-param-gather: {units} ZeRO-3 units of this rank's chunks "
                         "(one FP8 GEMM weight each) are all-gathered as e4m3 bytes; units "
                         "with a bias beside the weight, and the other parameters, gather in "
                         "their dtype")
        else:
            notes.append(f"> --fp8-param-gather: {units} FP8 GEMM weights of this rank's "
                         f"chunks are all-gathered after each step as e4m3 bytes with a "
                         f"power-of-two current scale each, and every rank computes with the "
                         f"decoded weights; the other parameters gather in their dtype")
    for line in notes:
        monitor.info(line)
    describe_run(run)
    if logging.log_straggler:  # installed before the comms logger, which wraps it
        run.stragglers = StragglerWatch(
            StragglerSettings(logging.straggler_minmax_count, logging.straggler_factor,
                              logging.straggler_patience), topo.rank, topo.world_size,
            env.device, log=monitor.info if is_reporter else None,
            warn=(lambda line: monitor.info(f"warning: {line}")) if is_reporter else None
        ).install()
    comms = CommsLoggerSettings.from_block(logging.comms_logger)
    if comms.enabled:
        run.comms_logger = CommsLogger(comms, log=monitor.info if is_reporter else None).install()
    run.state.spikes = SpikeWatch(cfg.train.spike_factor, cfg.train.spike_window)
    if cfg.data.eod_mask_loss:
        run.eod_mask = _eod_id(tokenizer)
    if cfg.data.reset_position_ids or cfg.data.reset_attention_mask:
        run.eod_id = _eod_id(tokenizer)
    engine.count_zeros_in_grad = cfg.logging.log_num_zeros_in_grad
    if cfg.checkpoint.save:
        run.owner = RunOwner.this_process(new_run_id()) if topo.rank == 0 else None
        for line in claim_save_dir(cfg.checkpoint.save, run.owner, topo, env.device):
            run.monitor.info(line)
    check_save_dir(cfg.checkpoint.save, checkpoint_bytes(engine), topo, env.device)
    if cfg.checkpoint.save and cfg.checkpoint.async_save:
        check_staging(checkpoint_bytes(engine), env.local_world_size or 1, topo, env.device)
        run.saver = AsyncSaver(topo.rank, topo.world_size, dist.distributed_c10d.
                               _get_default_store(), attempt_key("async-save"), env.device,
                               log=monitor.info if is_reporter else None)
    load(run)
    # a token-counted schedule continues from the tokens consumed (a checkpoint older than
    # token schedules holds the samples only)
    scheduler.step(0, tokens=run.state.consumed_samples * cfg.model.seq_length)
    return run


def _eod_id(tokenizer: Any) -> int:
    eod = getattr(tokenizer, "eod", None)
    if eod is None:
        raise ConfigError(f"--eod-mask-loss: the tokenizer ({type(tokenizer).__name__}) has no "
                          f"end-of-document token; drop the flag or use a tokenizer with one")
    return int(eod)


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
