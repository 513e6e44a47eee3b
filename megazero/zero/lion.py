"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

torch has no Lion; DeepSpeed's config names it (``"type": "Lion"``). Per element, with
gradient g, momentum m, learning rate lr and decoupled weight decay wd::

    c = beta1 * m + (1 - beta1) * g
    p = p - lr * (sign(c) + wd * p)
    m = beta2 * m + (1 - beta2) * g

The update is elementwise, so running it on any cut of a parameter into ZeRO pieces gives the
same numbers as on the whole parameter. Its one state tensor is ``exp_avg`` (m), created as
zeros on a parameter's first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 foreach: bool | None = None) -> None:
        """``foreach`` is accepted for the same call as torch's optimizers; the update always
        runs as multi-tensor (``torch._foreach_*``) operations."""
        if lr < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"Lion: lr {lr}, betas {betas} and weight_decay {weight_decay} "
                             "must be >= 0 (betas < 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            grads = [p.grad for p in params]
            ms = [self.state[p]["exp_avg"] for p in params]
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            cs = torch._foreach_mul(ms, beta1)
            torch._foreach_add_(cs, grads, alpha=1 - beta1)
            torch._foreach_sign_(cs)
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, cs, alpha=-lr)
            torch._foreach_mul_(ms, beta2)
            torch._foreach_add_(ms, grads, alpha=1 - beta2)
        return loss
