"""A rank's owned ranges of the parameters (:class:`Piece`): what the ZeRO engine keeps fp32
masters and optimizer state for, what a checkpoint saves per rank, and what the parameter
stores (:mod:`megazero.zero.buffers`, :mod:`megazero.zero.stage3`) hand the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Piece:
    param: nn.Parameter  # the model parameter this range belongs to (for its attributes)
    model: torch.Tensor  # 1-D view of the model's storage
    grad: torch.Tensor  # 1-D view of the reduced gradient
    master: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # MasterParams sets it
    ndim: int = -1  # the parameter's full rank (stage 3 releases parameters to 0 elements)
    offset: int = 0  # where ``model`` starts in the parameter's flattened values (checkpoints)
    # NVMe parameter offload: (the unit's swap, first element in its shard); ``model`` then has
    # no storage and its values live in the swap file (see megazero.zero.param_swap)
    swapped: tuple[Any, int] | None = None

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
            swapped = None if p.swapped is None else (p.swapped[0], p.swapped[1] + lo)
            out.append(Piece(p.param, p.model[lo:hi], p.grad[lo:hi], ndim=p.ndim,
                             offset=p.offset + lo, swapped=swapped))
    return out


def model_values(p: Piece) -> torch.Tensor:
    """The piece's current model-dtype values (read from the swap file when swapped out)."""
    return p.model if p.swapped is None else p.swapped[0].read_range(p.swapped[1], p.model.numel())


def store_model(p: Piece, values: torch.Tensor, non_blocking: bool = False) -> None:
    if p.swapped is None:
        p.model.copy_(values, non_blocking=non_blocking)
    else:
        p.swapped[0].write_range(p.swapped[1], values.to(p.model.dtype))
