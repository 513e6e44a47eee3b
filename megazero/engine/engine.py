"""The DeepSpeed-style training engine: forward, backward, step and checkpoints around any
``nn.Module``, with megazero's ZeRO optimizer (stages 0-3, CPU offload, fp16/bf16) underneath.

One optimizer step spans ``gradient_accumulation_steps`` micro-steps; each micro-step is
``loss = engine(batch); engine.backward(loss); engine.step()``:

* ``backward`` divides the loss by the accumulation steps (the gradient is the mean over the
  global batch), multiplies it by the fp16 loss scale, and runs autograd. Before the last
  micro-step of a step gradients only accumulate locally; on the last one they are reduced over
  data-parallel ranks as the ZeRO stage prescribes (all-reduce, reduce-scatter into shards).
* ``step`` at the boundary unscales, clips to ``gradient_clipping`` (global norm), runs the
  optimizer on the fp32 master shards, steps the schedule, and clears gradients; an fp16
  overflow on any rank skips the update and the schedule and lowers the scale instead
  (``was_step_applied()`` is then False). Between boundaries it only counts the micro-step.

The order is enforced: ``step()`` needs a ``backward()`` since the previous ``step()``, a second
``backward()`` before ``step()`` is refused (the engine accumulates micro-steps itself; calling
backward twice would count one micro-batch's gradient twice), and a loss from a forward in eval
mode, or a backward in eval mode, is refused. Each is an :class:`EngineStateError`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megazero.config import MegazeroConfig
from megazero.errors import MegazeroError
from megazero.observability.monitor import Timers

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology
    from megazero.zero.optimizer import ZeroOptimizer


class EngineStateError(MegazeroError, RuntimeError):
    """An engine method called out of order; the message says which call is missing."""


class MegazeroEngine:
    """Built by :func:`megazero.initialize`; see the module docstring for the step protocol."""

    def __init__(self, module: nn.Module, cfg: MegazeroConfig, topo: ParallelTopology,
                 optimizer: ZeroOptimizer, lr_scheduler: Any, client_optimizer: Any,
                 device: torch.device, local_rank: int, dataloader: Any = None,
                 log: Any = print) -> None:
        self.module = module
        self.config = cfg
        self.topo = topo
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.client_optimizer = client_optimizer
        self.device = device
        self.local_rank = local_rank
        self.global_rank = topo.rank
        self.world_size = topo.world_size
        self.dp_world_size = topo.dp_size
        self.training_dataloader = dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.log_fn = log  # receives each steps_per_print line (rank 0)
        self._backward_done = False
        self._last_forward_eval = False
        self._step_applied = False
        self._loss_sum: Any = 0.0  # a tensor once losses arrive: read only when a line is printed
        self._loss_count = 0
        self._last_result: Any = None
        # wall_clock_breakdown: forward / backward / step and each collective inside them
        self.timers = Timers(enabled=cfg.logging.wall_clock_breakdown, device=device)
        if self.timers.enabled:
            optimizer.comms.set_timers(self.timers)
        # A client scheduler object steers the client optimizer's groups: copy its learning
        # rates to the shards' optimizer before each update.
        self._lr_source = client_optimizer if (
            lr_scheduler is not None and client_optimizer is not None
            and getattr(lr_scheduler, "optimizer", None) is client_optimizer) else None
        self._sync_lr()

    def _sync_lr(self) -> None:
        if self._lr_source is not None:
            for mine, theirs in zip(self.optimizer.param_groups, self._lr_source.param_groups):
                mine["lr"] = theirs["lr"]

    # --- configuration queries (DeepSpeed's names) ----------------------------------------------

    def train_batch_size(self) -> int:
        return self.config.train.global_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.train.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero.offload_optimizer.enabled

    def gradient_clipping(self) -> float:
        return self.config.optimizer.clip_grad

    def fp16_enabled(self) -> bool:
        return self.config.precision.fp16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.bf16

    def steps_per_print(self) -> int:
        return self.config.logging.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.logging.wall_clock_breakdown

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` updates the weights (the last micro-step of a step)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """False when the last ``step()`` did not update the weights: not at a boundary, or
        skipped for an fp16 overflow."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last update, before clipping (None before one)."""
        return None if self._last_result is None else self._last_result.grad_norm

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    # --- mode -------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> MegazeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> MegazeroEngine:
        return self.train(False)

    # --- the step -----------------------------------------------------------------------------

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._last_forward_eval = not self.module.training
        with self.timers.region("forward"):
            return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        if not self.module.training:
            raise EngineStateError("engine.backward() called in eval mode; call engine.train() "
                                   "before training steps (engine.eval() is for evaluation)")
        if self._last_forward_eval:
            raise EngineStateError("engine.backward() after a forward that ran in eval mode (the "
                                   "last engine forward); call engine.train() before the "
                                   "forward of a training step")
        if self._backward_done:
            raise EngineStateError(
                "engine.backward() called twice without engine.step() between; call "
                "engine.step() after every backward (the engine accumulates "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps()} micro-steps "
                "itself and updates the weights at the boundary)")
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise EngineStateError("engine.backward() needs the loss tensor of a training "
                                   "forward (it does not require grad: computed under "
                                   "torch.no_grad(), or detached)")
        self.timers.start("backward")
        gas = self.gradient_accumulation_steps()
        scaled = loss / gas if scale_wrt_gas and gas > 1 else loss
        if self.fp16_enabled():
            scaled = scaled.float()  # an fp16 loss times the loss scale would overflow in fp16
        sync = self.is_gradient_accumulation_boundary()
        with nullcontext() if sync else self.optimizer.no_sync():
            self.optimizer.scale_loss(scaled).backward(retain_graph=retain_graph)
        self._backward_done = True
        self._loss_sum = self._loss_sum + loss.detach().float()
        self._loss_count += 1
        self.timers.stop("backward")
        return loss

    def step(self) -> None:
        if not self._backward_done:
            raise EngineStateError("engine.step() called without engine.backward() since the "
                                   "last step(); each micro-step is forward, backward, step")
        self._backward_done = False
        if self.is_gradient_accumulation_boundary():
            self.timers.start("step")
            self._sync_lr()
            result = self.optimizer.step()
            self._last_result = result
            self._step_applied = result.updated
            if result.updated:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                    self._sync_lr()
            else:
                self.skipped_steps += 1
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.timers.stop("step")
            self._report()
        else:
            self._step_applied = False
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Clear accumulated gradients (``step()`` does this after every update)."""
        self.optimizer.zero_grad()

    def _report(self) -> None:
        every = self.steps_per_print()
        total, count = self._loss_sum, max(1, self._loss_count)
        self._loss_sum, self._loss_count = 0.0, 0
        if not every or self.global_steps % every or self.global_rank != 0:
            return
        loss = float(total) / count
        r = self._last_result
        lr = ", ".join(f"{x:.4e}" for x in self.get_lr())
        # loss: rank 0's mean over every micro-batch since the last line (``every`` steps)
        window = f"loss(mean of {every} steps)" if every > 1 else "loss"
        line = (f"[megazero] step={self.global_steps} samples={self.global_samples} lr=[{lr}] "
                f"{window}={loss:.6f} grad_norm={r.grad_norm:.4f} loss_scale={r.loss_scale:g} "
                f"skipped={self.skipped_steps}")
        if self.timers.enabled:
            line += " | " + " ".join(f"{k}={v * 1000 / every:.1f}ms"
                                     for k, v in self.timers.pop_all().items())
        self.log_fn(line)

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Collective. Portable: loads at any data-parallel size and ZeRO stage."""
        from megazero.engine.checkpoint import save

        if exclude_frozen_parameters:
            raise MegazeroError("save_checkpoint(exclude_frozen_parameters=True) is not "
                                "supported: frozen weights are always saved (without "
                                "optimizer state); leave it False")
        return save(self, save_dir, tag, client_state or {}, save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None,
                        ) -> tuple[str | None, Any]:
        """Collective. ``tag=None`` loads the one ``load_dir/latest`` names; returns
        ``(path, client_state)``, or ``(None, None)`` when there is no checkpoint. Every
        parameter must be in the checkpoint whatever ``load_module_strict`` says.
        ``load_optimizer_states=False`` keeps the loaded weights as the fp32 masters with fresh
        Adam moments; ``load_module_only=True`` also keeps this engine's step counters."""
        from megazero.engine.checkpoint import load

        if custom_load_fn is not None:
            raise MegazeroError("load_checkpoint(custom_load_fn=...) is not supported; load "
                                "the weights with GatheredParameters(modifier_rank=0) instead")
        return load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only)
