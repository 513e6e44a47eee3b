"""``megazero.initialize``: DeepSpeed's entry point, so a DeepSpeed training loop runs on
megazero after changing the import::

    engine, optimizer, _, scheduler = megazero.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The engine is data parallel over the whole world (tp = pp = 1) with megazero's ZeRO optimizer
(stages 0-3, ``offload_optimizer`` cpu, fp16 dynamic loss scaling, bf16 with fp32 masters,
gradient clipping); see :mod:`megazero.engine.engine`.
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from megazero.config.observability_schema import CommsLoggerSettings
from megazero.distributed.startup import destroy
from megazero.engine.engine import EngineStateError, MegazeroEngine
from megazero.observability.comms_logging import CommsLogger

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology

__all__ = ["EngineStateError", "MegazeroEngine", "init_distributed", "initialize"]


def init_distributed(dist_backend: str | None = None, timeout_minutes: float = 30.0,
                     **_: Any) -> None:
    """Join torch.distributed from torchrun's environment (a world of one without a
    launcher); a no-op when the process group already exists."""
    if dist.is_initialized():
        return
    from megazero.distributed.startup import initialize_distributed

    initialize_distributed(dist_backend, timeout_minutes)
    _EXIT.arm(timedelta(minutes=timeout_minutes))


class _ExitInOrder:
    """At exit of a script whose process group :func:`init_distributed` made: a barrier, then
    ``destroy_process_group``, so no rank closes its connections while a peer still talks to it
    (gloo aborts such a peer: "terminate called without an active exception"). After an
    uncaught exception the peers may never reach a barrier: the group is only destroyed."""

    def __init__(self) -> None:
        self.failed = False
        self.timeout = timedelta(minutes=30)

    def arm(self, timeout: timedelta) -> None:
        self.timeout = timeout
        hook = sys.excepthook

        def note_failure(*exc: Any) -> None:
            self.failed = True
            hook(*exc)

        sys.excepthook = note_failure
        atexit.register(self.leave)

    def leave(self) -> None:
        if not dist.is_initialized():
            return
        if not self.failed and dist.get_world_size() > 1:
            try:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=self.timeout)
                else:
                    dist.barrier()
            except RuntimeError:
                pass  # a peer left first; nothing more to wait for
        destroy(orderly=not self.failed)


_EXIT = _ExitInOrder()


def _device() -> tuple[torch.device, int]:
    """This rank's device and local rank. On NCCL the CUDA device is chosen as DeepSpeed
    chooses it (:func:`megazero.distributed.device.engine_device_index`) and made current, also
    when the script called ``init_process_group`` itself (else every rank would work on GPU 0)."""
    from megazero.distributed.compat import bound_device_index
    from megazero.distributed.device import engine_device_index, read_launch

    launch = read_launch(os.environ)
    local_rank = launch.local_rank if launch is not None and launch.local_rank is not None \
        else 0
    if "nccl" not in str(dist.get_backend()):  # "nccl", or "cpu:gloo,cuda:nccl"
        return torch.device("cpu"), local_rank
    index = engine_device_index(os.environ, torch.cuda.device_count(), dist.get_rank(),
                                torch.cuda.current_device(), bound_device_index())
    torch.cuda.set_device(index)
    return torch.device("cuda", index), local_rank


def _mark_shared(module: nn.Module) -> None:
    """Parameters registered in more than one module (tied input / output embeddings) are used
    outside the module that owns them: stage 3 gathers them around the whole forward."""
    seen: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    for p in module.parameters():
        if seen.get(id(p), 0) > 1:
            p.zero_external = True


def _meta_initializer(model: nn.Module, stage: int, device: torch.device) -> Any:
    """For a model built under ``torch.device("meta")``: what materialises its ZeRO-3
    partitions (``model.param_initializer(device)``, which megazero's GPTModel provides; its
    meta buffers are recomputed on ``device``). None for a model on a real device."""
    from megazero.config import ConfigError

    if not any(p.is_meta for p in model.parameters()):
        return None
    make = getattr(model, "param_initializer", None)
    if stage != 3 or make is None:
        raise ConfigError(
            f"the model's parameters are on the meta device; megazero.initialize materialises "
            f"them only with zero_optimization.stage 3 (config has {stage}) and a model that "
            f"can compute its own values (param_initializer(device), e.g. megazero's GPTModel; "
            f"{type(model).__name__} has {'one' if make else 'none'}). Build the model on a "
            "real device, or inside megazero.zero.Init to partition it as it is built")
    model.materialize_buffers(device)
    return make(device)


def _dataloader(data: Any, engine_cfg: Any, topo: ParallelTopology, collate_fn: Any) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, num_replicas=topo.dp_size, rank=topo.dp_rank)
    return DataLoader(data, batch_size=engine_cfg.train.micro_batch_size, sampler=sampler,
                      collate_fn=collate_fn)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, config_params: Any = None,
               ) -> tuple[MegazeroEngine, Any, Any, Any]:
    """Wrap ``model`` for training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config``: a DeepSpeed config dict or JSON path (or ``config_params``, or
    ``args.deepspeed_config``). ``optimizer``: Adam/AdamW/SGD/Lion (its groups and settings are
    used on the fp32 master shards), a callable building one from ``model_parameters``, or None
    for the config's ``optimizer`` block. ``lr_scheduler``: an object, a callable taking the
    optimizer, or None for the config's ``scheduler`` block. ``training_data``: a dataset,
    returned as a DataLoader over this rank's share (micro-batch size, DistributedSampler).
    """
    from megazero.config import ConfigError
    from megazero.distributed.topology import ParallelTopology
    from megazero.engine.config import load_engine_config
    from megazero.engine.optim import build_optimizer, build_scheduler

    if model is None or not isinstance(model, nn.Module):
        raise ConfigError("megazero.initialize needs model= (a torch.nn.Module)")
    if mpu is not None:
        raise ConfigError("mpu= (model parallelism) is not supported by the megazero engine; it "
                          "is data parallel over all ranks. Use pretrain_gpt.py for tensor / "
                          "pipeline parallelism")
    if dist_init_required is not False:
        init_distributed()
    elif not dist.is_initialized():
        raise ConfigError("dist_init_required=False but torch.distributed is not initialised; "
                          "call megazero.init_distributed() first")
    cfg = load_engine_config(args, config, config_params, dist.get_world_size())
    device, local_rank = _device()
    topo = ParallelTopology.build(tp=1, pp=1)
    param_init = _meta_initializer(model, cfg.zero.stage, device)
    if param_init is None:
        model.to(device)
    for p in model.parameters():
        if p.is_meta:  # values computed from the seed, identical on every rank
            continue
        if getattr(p, "mz_shard", None) is not None:  # shards of a model built in zero.Init
            p.mz_shard = p.mz_shard.to(device)
        elif topo.dp_size > 1:  # every rank starts from rank 0's weights, however seeded
            dist.broadcast(p.data, src=0)
    if cfg.zero.stage == 3:
        _mark_shared(model)
    else:
        from megazero.zero.init_context import forget_partition, gather_partitioned, is_partitioned

        for p in model.parameters():  # stages 0-2 hold full parameters on every rank
            if is_partitioned(p):
                p.data = gather_partitioned(p)
                forget_partition(p)
    zero, client = build_optimizer(model, cfg, topo, optimizer, model_parameters,
                                   param_init=param_init)
    scheduler = build_scheduler(cfg, zero, lr_scheduler)
    for store in zero.stores:  # what zero.GatheredParameters needs to find its way back
        for p in store.params():
            p.mz_engine = zero
            if cfg.zero.stage == 3:
                p.mz_stage3_store = store
    loader = _dataloader(training_data, cfg, topo, collate_fn) if training_data is not None \
        else None
    engine = MegazeroEngine(model, cfg, topo, zero, scheduler, client, device, local_rank,
                            loader)
    comms = CommsLoggerSettings.from_block(cfg.logging.comms_logger)
    if comms.enabled:  # megazero.observability.comms_logging.log_summary() prints its table
        CommsLogger(comms, log=print if topo.rank == 0 else None).install()
    return engine, zero, loader, scheduler
