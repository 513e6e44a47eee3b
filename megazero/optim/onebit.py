"""1-bit Adam (Tang et al. 2021; DeepSpeed's ``"type": "OneBitAdam"``): Adam whose
data-parallel exchange drops to about 1 bit per element after a full-precision warm-up.

Steps 1 .. ``freeze_step`` are Adam with decoupled weight decay on the data-parallel average of
the gradients (AdamW's numbers). From then on the variance ``v`` is frozen (the paper's
observation: it is stable after warm-up, and it is what makes Adam non-linear), the gradients
are *not* averaged over data-parallel ranks, and each rank folds its own gradient into its
momentum, which is then averaged with the compressed all-reduce
(:mod:`megazero.optim.compressed`, worker and server error feedback kept per parameter)::

    m = beta1 * m + (1 - beta1) * g_local ;  m = compressed_average(m)
    p = p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)

``m_hat``, ``v_hat``: Adam's bias corrections (``bias_correction``; v's is frozen with v).
DeepSpeed's 1-bit Adam leaves them out whatever its ``bias_correction`` says; megazero honours
the parameter, so the warm-up equals torch's AdamW, and ``"bias_correction": false`` gives
DeepSpeed's numbers. ``cuda_aware`` and ``comm_backend_name`` choose DeepSpeed's MPI or NCCL
transport; megazero's exchange runs over the data-parallel process group's backend (gloo or
NCCL) either way.

The engine owns the switch: ``local_grads`` (set by the build) turns the data-parallel
gradient reduction off for the compressed phase and on again for a warm-up resumed from a
checkpoint; ``compress`` is the group's compressed all-reduce (None with one dp rank).
DeepSpeed runs 1-bit Adam without ZeRO only; so does megazero (stage 0). Gradient clipping
(``gradient_clipping``) in the compressed phase takes data-parallel rank 0's local gradient
norm (stage 0 counts one replica's gradients, and they are no longer averaged); every rank
applies that same coefficient, so the replicas stay equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megazero.optim.compressed import CompressedAllReduce, PhasedOptimizer, error_buffers


class OneBitAdam(PhasedOptimizer):
    #: per-rank state (saved per rank, megazero.optim.onebit_state)
    rank_state = ("worker_error", "server_error")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 foreach: bool | None = None) -> None:
        """DeepSpeed's parameters and defaults; ``foreach`` is accepted for the same call as
        torch's optimizers (the update runs per tensor)."""
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"OneBitAdam: lr {lr}, eps {eps}, weight_decay {weight_decay} must "
                             f"be >= 0 and betas {betas} in [0, 1)")
        if freeze_step < 1:
            raise ValueError(f"OneBitAdam: freeze_step {freeze_step} must be >= 1 (the "
                             "full-precision warm-up fills the variance it freezes)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay,
                                  "bias_correction": bias_correction})
        self.freeze_step = freeze_step
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.compress: CompressedAllReduce | None = None
        self.local_grads: Callable[[bool], None] | None = None

    @property
    def compressing(self) -> bool:
        """Whether the next step exchanges compressed momenta (the warm-up is over)."""
        return self._steps_done() >= self.freeze_step

    def sync_phase(self) -> None:
        """Tell the engine which gradients the next step takes: local ones once compressing."""
        if self.local_grads is not None:
            self.local_grads(self.compressing)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compress is not None:
            self.compress.reset_bytes()  # the counters hold this step's exchange
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                self.init_moments(st, p)
                st["step"] += 1
                t = int(st["step"])
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if t <= self.freeze_step:
                    v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                elif self.compress is not None and self.compress.world > 1:
                    if "worker_error" not in st:
                        st["worker_error"], st["server_error"] = error_buffers(
                            p.numel(), self.compress.world, p.device)
                    self.compress(m, st["worker_error"], st["server_error"])
                bc1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
                bc2 = 1 - beta2 ** min(t, self.freeze_step) if group["bias_correction"] else 1.0
                denom = (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, denom, value=-group["lr"] / bc1)
        self.sync_phase()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.sync_phase()


def dp_switch(stores: list[Any], dp: Any, local: Any) -> Callable[[bool], None]:
    """``local_grads`` for the stage-0 gradient buffers: each buffer reduces over ``dp`` (the
    warm-up) or over ``local`` (a one-rank group: gradients stay this rank's, averaged over
    its micro-batches only)."""

    def switch(compressing: bool) -> None:
        for store in stores:
            store.dp = local if compressing else dp

    return switch


def attach(opt: Any, stores: list[Any], comms: Any) -> None:
    """Wire a :class:`OneBitAdam` (or a ZeroOneAdam) built over stage-0 masters to the engine:
    the compressed all-reduce over the data-parallel group (its bytes go to the engine's
    per-step comm log) and the switch of the gradient buffers between dp and local reduction."""
    from megazero.distributed.group_comm import GroupComm

    if comms.dp.size > 1:
        opt.compress = CompressedAllReduce(comms.dp.group, log=comms.log, name=comms.dp.name)
    opt.local_grads = dp_switch(stores, comms.dp, GroupComm(None, comms.dp.name, comms.log))
    opt.sync_phase()



def exchange_scalars(engine: Any) -> dict[str, float]:
    """The last step's compressed exchange for the log: ``compressed-allreduce-bytes`` (what
    this rank sent in signs and scales, from the engine's comm log), ``compressed-scale-bytes``
    (the scales' share) and ``fp32-allreduce-bytes`` (a ring all-reduce of the same momenta in
    fp32); empty when the step exchanged no compressed momenta."""
    sent = engine.comm_report()["logical_bytes"].get("dp/compressed_allreduce")
    c = getattr(getattr(engine, "masters", None), "optimizer", None)
    c = getattr(c, "compress", None)
    if sent is None or c is None:
        return {}
    return {"compressed-allreduce-bytes": float(sent), "compressed-scale-bytes": c.scale_bytes,
            "fp32-allreduce-bytes": c.fp32_bytes}
