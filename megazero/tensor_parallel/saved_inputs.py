"""Where a fully recomputed layer group keeps its input until backward.

Full recomputation keeps one tensor per layer group and micro-batch in flight: the group's
input, ``[s, b, h]``. Without sequence parallelism every tensor-parallel rank holds the same
copy of it. Megatron's ``--distribute-saved-activations`` (DeepSpeed's
``activation_checkpointing.partition_activations``) keeps only this rank's 1/tp of its
elements and all-gathers the whole over the tensor-parallel group when the recomputation
needs it; DeepSpeed's ``cpu_checkpointing`` keeps what is kept in host memory (pinned on a
GPU run) and brings it back to the device first. The values are the same bits either way, so
training is unchanged; the all-gather (one per group and micro-batch, the size of the input)
and the host copies are the cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megazero.distributed.collectives import all_gather


@dataclass(frozen=True)
class SavedInputLayout:
    """How :func:`megazero.tensor_parallel.random.checkpoint` keeps a group's input."""

    group: Any = None  # the tensor-parallel group to split over (None: keep it whole)
    rank: int = 0
    size: int = 1
    to_host: bool = False

    @property
    def changes_anything(self) -> bool:
        return self.size > 1 or self.to_host

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """What is kept of ``x``: this rank's contiguous 1/size of its elements (the last rank's
        piece padded with zeros to the same length), on the host if ``to_host``."""
        flat = x.detach().reshape(-1)
        if self.size > 1:
            piece = -(-flat.numel() // self.size)
            lo = min(flat.numel(), self.rank * piece)
            mine = flat[lo:lo + piece]
            kept = torch.zeros(piece, dtype=flat.dtype, device=flat.device)
            kept[:mine.numel()].copy_(mine)
        else:
            kept = flat.clone()
        if self.to_host and kept.device.type != "cpu":
            host = torch.empty(kept.shape, dtype=kept.dtype, device="cpu",
                               pin_memory=torch.cuda.is_available())
            host.copy_(kept, non_blocking=True)
            kept = host
        return kept

    def unpack(self, kept: torch.Tensor, shape: torch.Size, device: torch.device
               ) -> torch.Tensor:
        """The whole input again (shape ``shape``, on ``device``), from every rank's piece."""
        piece = kept.to(device, non_blocking=True)
        if self.size > 1:
            whole = torch.empty(piece.numel() * self.size, dtype=piece.dtype, device=device)
            all_gather(whole, piece, self.group)
            piece = whole
        return piece[:shape.numel()].view(shape)
