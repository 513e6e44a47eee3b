"""fp32 master weights for this rank's shard and the stock torch optimizer that updates them.

The shard is described as *pieces*: one contiguous 1-D range of one parameter that this rank
owns (a bucket shard can cut a parameter anywhere). Each piece has a view of the model's storage
(model dtype), a view of its reduced gradient and an fp32 master tensor. In fp32 training without
offload the master *is* the model view (no copy: updates land directly in the flat parameter
buffer); otherwise masters are views of one flat fp32 buffer, on the host when the optimizer is
offloaded.

The stock optimizer (``torch.optim.AdamW``, foreach) sees only the masters, in two groups:
weight decay for matrices, none for biases and norm weights (``ndim < 2``). The step runs over
*sub-groups* of at most ``sub_group_size`` elements: only one sub-group's fp32 gradients exist at
a time, which bounds the temporary memory of casting and (with offload) of the device-to-host
copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megazero.config import OptimizerConfig
from megazero.zero.offload import host_empty


@dataclass
class Piece:
    param: nn.Parameter  # the model parameter this range belongs to (for its attributes)
    model: torch.Tensor  # 1-D view of the model's storage
    grad: torch.Tensor  # 1-D view of the reduced gradient
    master: torch.Tensor | None = None
    ndim: int = -1  # the parameter's full rank (stage 3 releases parameters to 0 elements)
    offset: int = 0  # where ``model`` starts in the parameter's flattened values (checkpoints)

    def __post_init__(self) -> None:
        if self.ndim < 0:
            self.ndim = self.param.ndim


def split_pieces(pieces: list[Piece], limit: int) -> list[Piece]:
    """Cut pieces longer than ``limit`` so that sub-groups can respect ``sub_group_size``."""
    out: list[Piece] = []
    for p in pieces:
        n = p.model.numel()
        for lo in range(0, n, max(1, limit)):
            hi = min(n, lo + limit)
            out.append(Piece(p.param, p.model[lo:hi], p.grad[lo:hi], ndim=p.ndim,
                             offset=p.offset + lo))
    return out


def make_torch_optimizer(groups: list[dict[str, Any]], cfg: OptimizerConfig,
                         ) -> torch.optim.Optimizer:
    """AdamW for both ``adam`` and ``adamw``: Megatron and DeepSpeed (``adam_w_mode``) both use
    decoupled weight decay for Adam."""
    if cfg.optimizer not in ("adam", "adamw"):
        raise ValueError(f"optimizer {cfg.optimizer!r} is not supported; use adam or adamw")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay, foreach=True)


class MasterParams:
    """Masters + optimizer for the pieces this rank owns."""

    def __init__(self, pieces: list[Piece], cfg: OptimizerConfig, *, offload: bool,
                 pin_memory: bool, sub_group_size: int) -> None:
        self.pieces = split_pieces([p for p in pieces if p.model.numel()], sub_group_size)
        self.offload = offload
        dtypes = {p.model.dtype for p in self.pieces}
        self.copy = offload or dtypes != {torch.float32}
        self.flat: torch.Tensor | None = None
        total = sum(p.model.numel() for p in self.pieces)
        if self.copy:
            device = self.pieces[0].model.device if self.pieces else torch.device("cpu")
            self.flat = (host_empty(total, torch.float32, pin_memory) if offload
                         else torch.empty(total, dtype=torch.float32, device=device))
            pos = 0
            for p in self.pieces:
                n = p.model.numel()
                p.master = self.flat[pos:pos + n]
                p.master.copy_(p.model)
                pos += n
        else:
            for p in self.pieces:
                p.master = p.model
        decay = [p.master for p in self.pieces if p.ndim >= 2]
        no_decay = [p.master for p in self.pieces if p.ndim < 2]
        groups = [{"params": decay, "name": "decay"},
                  {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
        self.optimizer = make_torch_optimizer(groups, cfg)
        self.sub_groups: list[list[Piece]] = []
        size = sub_group_size
        for p in self.pieces:
            if not self.sub_groups or size + p.model.numel() > sub_group_size:
                self.sub_groups.append([])
                size = 0
            self.sub_groups[-1].append(p)
            size += p.model.numel()

    def step(self, factor: float) -> None:
        """One optimizer step with every gradient multiplied by ``factor`` (unscale * clip)."""
        for group in self.sub_groups:
            grads = []
            for p in group:
                g = p.grad
                if self.copy:
                    g = g.to(device=p.master.device, dtype=torch.float32, copy=True)
                grads.append(g)
            if factor != 1.0:
                torch._foreach_mul_(grads, factor)
            for p, g in zip(group, grads):
                p.master.grad = g
            self.optimizer.step()
            for p in group:
                p.master.grad = None
                if self.copy:
                    p.model.copy_(p.master, non_blocking=True)

    def sync_masters_from_model(self) -> None:
        """After model weights were loaded from outside (a checkpoint without optimizer state)."""
        if self.copy:
            for p in self.pieces:
                p.master.copy_(p.model)

    def sync_model_from_masters(self) -> None:
        if self.copy:
            for p in self.pieces:
                p.model.copy_(p.master)

    def held(self) -> list[torch.Tensor]:
        """Optimizer-state storage: separate masters (if any) and moments."""
        out: list[torch.Tensor] = [self.flat] if self.flat is not None else []
        for state in self.optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out

    def state_dict(self) -> dict[str, Any]:
        masters = (self.flat.clone() if self.flat is not None
                   else torch.cat([p.master.detach().reshape(-1) for p in self.pieces])
                   if self.pieces else torch.empty(0))
        return {"masters": masters, "optimizer": self.optimizer.state_dict(),
                "piece_numels": [p.model.numel() for p in self.pieces]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        numels = [p.model.numel() for p in self.pieces]
        if list(sd["piece_numels"]) != numels:
            raise ValueError("optimizer shard layout differs from this run's (different model, "
                             "parallel layout, ZeRO stage or bucket sizes); reshard first")
        pos = 0
        for p, n in zip(self.pieces, numels):
            p.master.copy_(sd["masters"][pos:pos + n])
            pos += n
        self.optimizer.load_state_dict(sd["optimizer"])
        self.sync_model_from_masters()
