"""0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam"; DeepSpeed's ``"type": "ZeroOneAdam"``), DeepSpeed's rule and parameters.

Two phases, by step t (1-based) and DeepSpeed's schedule:

* up to ``var_freeze_step`` + 1: the variance is refreshed only every ``var_interval`` steps;
  on those steps the gradients are averaged in full precision (the engine's dp all-reduce) and
  update both moments; on the others each rank's gradient is averaged with the 1-bit compressed
  all-reduce (:mod:`megazero.optim.compressed`) and updates the momentum alone. ``var_interval``
  starts at 1 and doubles after every ``var_update_scaler`` refreshes.
* after it the variance is frozen and ranks take *local steps* on their own gradients,
  accumulating the updates; every ``local_step_interval`` steps the accumulated update (scaled
  back to momentum units by ``sqrt(v) + eps``) is averaged with the compressed all-reduce and
  replaces the local ones, and the momentum is re-derived from it. ``local_step_interval``
  starts at 1 and doubles every ``local_step_scaler`` steps, up to ``local_step_clipper``.
  The error buffers are zeroed once when this phase starts (they held gradient errors).

The update is ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``. As in DeepSpeed, 0/1 Adam
applies no bias correction (``bias_correction`` is accepted and recorded), and between two
synchronisations the data-parallel replicas differ (the local steps); a checkpoint holds rank
0's weights and each rank's error buffers, momentum accumulator and learning-rate sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from megazero.optim.compressed import CompressedAllReduce, PhasedOptimizer, error_buffers


class ZeroOneAdam(PhasedOptimizer):
    #: per-rank state (saved per rank, megazero.optim.onebit_state)
    rank_state = ("worker_error", "server_error", "momentum_accumulator", "lrs")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 foreach: bool | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"ZeroOneAdam: lr {lr}, eps {eps}, weight_decay {weight_decay} "
                             f"must be >= 0 and betas {betas} in [0, 1)")
        if min(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper) < 1:
            raise ValueError("ZeroOneAdam: var_freeze_step, var_update_scaler, "
                             "local_step_scaler and local_step_clipper must be >= 1")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay,
                                  "bias_correction": bias_correction})
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.compress: CompressedAllReduce | None = None
        self.local_grads: Callable[[bool], None] | None = None
        self._reset_schedule()

    # --- DeepSpeed's schedule, a function of the step count ------------------------------------

    def _reset_schedule(self) -> None:
        self.var_interval, self.var_counter = 1, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.frozen, self.counted = False, 0

    def _advance(self, t: int) -> None:
        """The schedule after step t (DeepSpeed's counters)."""
        if not self.frozen:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper,
                                               self.local_step_interval * 2)
        if t > self.var_freeze_step:
            self.frozen = True
        self.counted = t

    def full_step(self, t: int) -> bool:
        """Whether step t averages the gradients in full precision (refreshes the variance)."""
        return not self.frozen and t % self.var_interval == 0

    def sync_phase(self) -> None:
        """Bring the schedule to the step count (after a load) and tell the engine whether the
        next step's gradients are averaged (a variance step) or stay local."""
        done = self._steps_done()
        if done != self.counted:
            self._reset_schedule()
            for t in range(1, done + 1):
                self._advance(t)
        if self.local_grads is not None:
            self.local_grads(not self.full_step(done + 1))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compress is not None:
            self.compress.reset_bytes()
        multi = self.compress is not None and self.compress.world > 1
        t = self._steps_done() + 1
        frozen, full = self.frozen, self.full_step(t)
        sync = frozen and t % self.local_step_interval == 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                self.init_moments(st, p)
                if "worker_error" not in st:
                    n = self.compress.world if multi and self.compress is not None else 1
                    st["worker_error"], st["server_error"] = error_buffers(p.numel(), n, p.device)
                    st["momentum_accumulator"] = torch.zeros_like(p)
                    st["lrs"] = torch.zeros((), dtype=torch.float64)
                st["step"] += 1
                m, v, acc = st["exp_avg"], st["exp_avg_sq"], st["momentum_accumulator"]
                g = p.grad
                if not frozen:
                    if full:
                        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    elif multi and self.compress is not None:
                        g = g.clone()
                        self.compress(g, st["worker_error"], st["server_error"])
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                else:
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    st["lrs"] += lr
                denom = v.sqrt().add_(eps)
                update = m / denom
                if wd:
                    update.add_(p, alpha=wd)
                p.add_(update, alpha=-lr)
                if frozen:
                    acc.add_(update, alpha=-lr)
                if sync:
                    p.sub_(acc)  # back to the last synchronised weights
                    acc.mul_(denom)
                    if multi and self.compress is not None:
                        self.compress(acc, st["worker_error"], st["server_error"])
                    m.copy_(acc / -float(st["lrs"]))
                    p.add_(acc / denom)
                    acc.zero_()
                    st["lrs"].zero_()
        was_frozen = self.frozen
        self._advance(t)
        if self.frozen and not was_frozen:  # the errors held gradients; momenta follow
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state.get(p, {})
                    for name in ("worker_error", "server_error"):
                        if name in st:
                            st[name].zero_()
        if self.local_grads is not None:
            self.local_grads(not self.full_step(t + 1))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.sync_phase()
