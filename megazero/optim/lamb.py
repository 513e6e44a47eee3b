"""Lamb (You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2) with DeepSpeed's parameters and rule (``"type": "Lamb"``, its FusedLamb).

Per parameter tensor W with gradient g, step t (DeepSpeed's kernel, eps outside the root)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * W
    coeff = clamp(||W|| / ||u||, min_coeff, max_coeff)   (1 where either norm is 0)
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)  (lr without bias_correction)
    W = W - step_size * coeff * u

Unlike Adam the update is not elementwise: ``coeff`` (the trust ratio) needs the norms of the
whole parameter and of its whole update. Under ZeRO a rank holds *pieces* of parameters, and
under tensor parallelism a slice of each, so the step runs in two phases that a caller can
split around one reduction: :meth:`Lamb.partial_sums` updates the moments and returns each
tensor's ``(sum W^2, sum u^2)``; the caller sums those over the pieces and ranks that make up
each whole parameter (:mod:`megazero.optim.whole_norms`) and hands the coefficients to
:meth:`Lamb.apply`, which recomputes ``u`` from the stored moments (no update tensor is kept
between the phases) and writes the weights. :meth:`Lamb.step` does both with each tensor taken
as a whole parameter (one process, no ZeRO).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def trust_ratio(w_sq: float, u_sq: float, min_coeff: float, max_coeff: float) -> float:
    """DeepSpeed's Lamb coefficient from the squared norms of a whole parameter and update."""
    w, u = math.sqrt(max(w_sq, 0.0)), math.sqrt(max(u_sq, 0.0))
    if w == 0.0 or u == 0.0:
        return 1.0
    return min(max(w / u, min_coeff), max_coeff)


class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01,
                 foreach: bool | None = None) -> None:
        """DeepSpeed's FusedLamb defaults. ``foreach`` is accepted for the same call as
        torch's optimizers (the factory passes it); the update runs per tensor."""
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Lamb: lr {lr}, eps {eps}, weight_decay {weight_decay} must be "
                             f">= 0 and betas {betas} in [0, 1)")
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need 0 < min_coeff ({min_coeff}) <= max_coeff "
                             f"({max_coeff})")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay,
                                  "bias_correction": bias_correction,
                                  "max_coeff": max_coeff, "min_coeff": min_coeff})

    def _group_of(self) -> dict[int, dict[str, Any]]:
        return {id(p): g for g in self.param_groups for p in g["params"]}

    def _update(self, p: torch.Tensor, g: dict[str, Any]) -> torch.Tensor:
        st = self.state[p]
        u: torch.Tensor = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + g["eps"])
        if g["weight_decay"]:
            u.add_(p, alpha=g["weight_decay"])
        return u

    @torch.no_grad()
    def partial_sums(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Phase 1 for ``params`` (each with ``.grad`` set): count the step, update the moments,
        and return a ``(len(params), 2)`` float64 tensor of ``sum W^2`` and ``sum u^2``."""
        groups = self._group_of()
        out = torch.zeros(len(params), 2, dtype=torch.float64)
        for i, p in enumerate(params):
            g, grad = groups[id(p)], p.grad
            assert grad is not None, "Lamb.partial_sums needs every tensor's gradient"
            st = self.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            st["step"] += 1
            beta1, beta2 = g["betas"]
            st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            u = self._update(p, g)
            out[i, 0] = p.double().square().sum()
            out[i, 1] = u.double().square().sum()
        return out

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], coeffs: Sequence[float]) -> None:
        """Phase 2: ``W -= step_size * coeff * u`` with each tensor's whole-parameter ``coeff``
        (:func:`trust_ratio` of its reduced sums)."""
        groups = self._group_of()
        for p, coeff in zip(params, coeffs):
            g, st = groups[id(p)], self.state[p]
            t = float(st["step"])
            beta1, beta2 = g["betas"]
            step_size = g["lr"]
            if g["bias_correction"]:
                step_size = g["lr"] * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
            p.add_(self._update(p, g), alpha=-step_size * coeff)

    def coefficients(self, params: Sequence[torch.Tensor], sums: torch.Tensor) -> list[float]:
        """:func:`trust_ratio` per tensor from whole-parameter squared norms ``sums``."""
        groups = self._group_of()
        return [trust_ratio(float(s[0]), float(s[1]), groups[id(p)]["min_coeff"],
                            groups[id(p)]["max_coeff"]) for p, s in zip(params, sums.tolist())]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Both phases, each tensor a whole parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if params:
            self.apply(params, self.coefficients(params, self.partial_sums(params)))
        return loss
