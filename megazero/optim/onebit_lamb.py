"""1-bit Lamb (Li et al. 2021, "1-bit LAMB"; DeepSpeed's ``"type": "OneBitLamb"``) with
DeepSpeed's rule and parameters, at ZeRO stage 0 (as DeepSpeed).

Steps 1 .. ``freeze_step``: Lamb (:mod:`megazero.optim.lamb`, no bias correction as DeepSpeed's
1-bit Lamb) on the data-parallel average of the gradients, keeping an average of the trust
ratios that were not 1: ``lamb_coeff_freeze = coeff_beta * it + (1 - coeff_beta) * ratio``. At
``freeze_step`` the variance is frozen and copied to a *fresh* variance that keeps tracking.

Then each rank folds its own gradient into its momentum, scaled by a per-parameter
``scaling_coeff`` (the mean momentum RMS over the parameters / this parameter's, fixed at the
first compressed step so that every momentum has a similar scale), and the momenta are averaged
with the 1-bit compressed all-reduce (:mod:`megazero.optim.compressed`, per parameter, worker
and server error feedback) and unscaled. The gradient implied by the momentum step refreshes
the fresh variance; the trust ratio is the frozen one times a *factor*: the largest
``(sqrt(v) + eps) / (sqrt(v_fresh) + eps)`` of the parameter, mixed towards 1 by the share of
weight decay in the update, clamped to [``factor_min``, ``factor_max``] and to within
``factor_threshold`` of the previous factor::

    p -= lr * lamb_coeff_freeze * factor * (m / (sqrt(v) + eps) + weight_decay * p)

Every norm and maximum is over the whole parameter: its TP slices are reduced over the tensor-
parallel group (:class:`megazero.optim.whole_norms.WholeParamNorms`, set by the build as
``whole``), so the result does not depend on tp. The step takes every parameter at once (one
reduction per step): the build refuses a ``sub_group_size`` that would cut them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megazero.optim.compressed import CompressedAllReduce, PhasedOptimizer, error_buffers
from megazero.optim.lamb import trust_ratio


class OneBitLamb(PhasedOptimizer):
    #: per-rank state (saved per rank, megazero.optim.onebit_state)
    rank_state = ("worker_error", "server_error", "lamb_coeff_freeze", "last_factor",
                  "scaling_coeff")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", foreach: bool | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"OneBitLamb: lr {lr}, eps {eps}, weight_decay {weight_decay} must "
                             f"be >= 0 and betas {betas} in [0, 1)")
        if freeze_step < 1 or not 0 < factor_min <= factor_max:
            raise ValueError(f"OneBitLamb: freeze_step {freeze_step} must be >= 1 and 0 < "
                             f"factor_min ({factor_min}) <= factor_max ({factor_max})")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay,
                                  "bias_correction": bias_correction,
                                  "max_coeff": max_coeff, "min_coeff": min_coeff})
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.compress: CompressedAllReduce | None = None
        self.local_grads: Callable[[bool], None] | None = None
        self.whole: Any = None  # WholeParamNorms over this stage's params (tp), set by the build
        self.owner: dict[int, Any] = {}  # id(master) -> its model parameter (the whole's key)

    def sync_phase(self) -> None:
        if self.local_grads is not None:
            self.local_grads(self._steps_done() >= self.freeze_step)

    def _sums(self, params: list[torch.Tensor], cols: torch.Tensor) -> torch.Tensor:
        """Whole-parameter sums of ``cols`` (one row per tensor)."""
        if self.whole is None:
            return cols
        return self.whole([self.owner.get(id(p), p) for p in params], cols)  # type: ignore[no-any-return]

    def _maxes(self, params: list[torch.Tensor], vals: torch.Tensor) -> torch.Tensor:
        if self.whole is None:
            return vals
        return self.whole.max([self.owner.get(id(p), p) for p in params], vals)  # type: ignore[no-any-return]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compress is not None:
            self.compress.reset_bytes()
        items = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not items:
            return loss
        params = [p for p, _ in items]
        for p in params:
            st = self.state[p]
            if self.init_moments(st, p):
                st["exp_avg_sq_fresh"] = torch.zeros_like(p)
                st["lamb_coeff_freeze"] = torch.zeros((), dtype=torch.float64)
                st["last_factor"] = torch.ones((), dtype=torch.float64)
            st["step"] += 1
        t = int(self.state[params[0]]["step"])
        if t <= self.freeze_step:
            self._warmup(items, t)
        else:
            self._compressed(items)
        self.sync_phase()
        return loss

    def _warmup(self, items: list[tuple[torch.Tensor, dict[str, Any]]], t: int) -> None:
        sums = torch.zeros(len(items), 2, dtype=torch.float64)
        updates = []
        for i, (p, g) in enumerate(items):
            st, grad = self.state[p], p.grad
            assert grad is not None
            beta1, beta2 = g["betas"]
            st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if t == self.freeze_step:
                st["exp_avg_sq_fresh"].copy_(st["exp_avg_sq"])
            u = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + g["eps"])
            if g["weight_decay"]:
                u.add_(p, alpha=g["weight_decay"])
            updates.append(u)
            sums[i, 0] = p.double().square().sum()
            sums[i, 1] = u.double().square().sum()
        whole = self._sums([p for p, _ in items], sums).tolist()
        for (p, g), u, (w_sq, u_sq) in zip(items, updates, whole):
            st = self.state[p]
            coeff = trust_ratio(w_sq, u_sq, g["min_coeff"], g["max_coeff"])
            if coeff != 1.0:
                st["lamb_coeff_freeze"].mul_(self.coeff_beta).add_((1 - self.coeff_beta) * coeff)
            p.add_(u, alpha=-g["lr"] * coeff)

    def _compressed(self, items: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        params = [p for p, _ in items]
        if "scaling_coeff" not in self.state[params[0]]:
            # DeepSpeed: each momentum scaled to the mean RMS, so one bit per element fits all
            sq = torch.tensor([[float(self.state[p]["exp_avg"].double().square().sum()),
                                float(p.numel())] for p in params], dtype=torch.float64)
            whole = self._sums(params, sq)
            rms = (whole[:, 0] / whole[:, 1]).sqrt()
            rows = {id(self.owner.get(id(p), p)): r for p, r in zip(params, rms.tolist())}
            united = sum(rows.values()) / len(rows)
            for p, r in zip(params, rms.tolist()):
                self.state[p]["scaling_coeff"] = torch.tensor(united / r if r > 0 else 1.0,
                                                              dtype=torch.float64)
        multi = self.compress is not None and self.compress.world > 1
        sums = torch.zeros(len(items), 2, dtype=torch.float64)
        ratio = torch.zeros(len(items), dtype=torch.float64)
        parts = []
        for i, (p, g) in enumerate(items):
            st, grad = self.state[p], p.grad
            assert grad is not None
            beta1, beta2 = g["betas"]
            m, scale = st["exp_avg"], float(st["scaling_coeff"])
            last = m.clone()
            m.mul_(beta1).add_(grad, alpha=1 - beta1).mul_(scale)
            if multi and self.compress is not None:
                if "worker_error" not in st:
                    st["worker_error"], st["server_error"] = error_buffers(
                        p.numel(), self.compress.world, p.device)
                self.compress(m, st["worker_error"], st["server_error"])
            m.div_(scale)
            implied = (m - last * beta1) / (1 - beta1)
            st["exp_avg_sq_fresh"].mul_(beta2).addcmul_(implied, implied, value=1 - beta2)
            denom = st["exp_avg_sq"].sqrt().add_(g["eps"])
            prelim = m / denom
            update = prelim + g["weight_decay"] * p if g["weight_decay"] else prelim
            sums[i, 0] = prelim.double().square().sum()
            sums[i, 1] = update.double().square().sum()
            ratio[i] = float((denom / (st["exp_avg_sq_fresh"].sqrt() + g["eps"])).max())
            parts.append(update)
        norms = self._sums(params, sums).tolist()
        factors = self._maxes(params, ratio).tolist()
        for (p, g), update, (pre_sq, up_sq), factor in zip(items, parts, norms, factors):
            st = self.state[p]
            if g["weight_decay"] and up_sq > 0:
                share = min(1.0, math.sqrt(pre_sq / up_sq))
                factor = factor * share + (1.0 - share)
            last_factor = float(st["last_factor"])
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(max(factor, last_factor * (1.0 - self.factor_threshold)),
                         last_factor * (1.0 + self.factor_threshold))
            st["last_factor"].fill_(factor)
            p.add_(update, alpha=-g["lr"] * float(st["lamb_coeff_freeze"]) * factor)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.sync_phase()
