"""Delayed scaling: a tensor's scale comes from the amaxes of earlier steps.

Each FP8 operand of a linear (its input ``x``, weight ``w`` and output gradient ``dy``) keeps an
:class:`AmaxHistory`. During a step the scale is fixed (it was computed at the end of the
previous step) and every use records the tensor's amax; at the end of the step
:func:`finish_step` max-reduces the recorded amaxes over every rank that holds the layer
(tensor-, context- and data-parallel ranks of the stage), pushes them onto the history and
computes the next scale: ``most_recent`` takes the newest amax, ``max`` the largest of the
window (``--fp8-amax-compute-algo``), less ``--fp8-margin`` binades.

A step's amax is the max over its micro-batches and over the ranks, so it does not depend on
how the batch was split: the history, and therefore the scale, is the same at every layout,
and it is a layout-free tensor a checkpoint can hold and any layout can resume.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megazero.distributed.collectives import Group
from megazero.fp8.quantize import reduce_amax, scale_from_amax


class AmaxHistory:
    """Newest amax first; ``current`` is this step's running max (0 until a use)."""

    def __init__(self, length: int, algo: str, dtype: torch.dtype, margin: int,
                 device: torch.device | None = None):
        self.algo, self.dtype, self.margin = algo, dtype, margin
        self.history = torch.zeros(length, dtype=torch.float32, device=device)
        self.current = torch.zeros((), dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        # steps whose amax left the range the step's scale covered: above the FP8 maximum
        # (values clipped) or, for a nonzero tensor, below the smallest normal (all subnormal)
        self.overflows = 0
        self.underflows = 0

    def record(self, amax: torch.Tensor) -> None:
        self.current = torch.maximum(self.current, amax.detach().float().to(self.current.device))

    def push(self, amax: torch.Tensor) -> str | None:
        """End of a step: ``amax`` (already reduced over the ranks) joins the history.
        Returns ``"overflow"`` / ``"underflow"`` when the step's scale did not cover it."""
        info = torch.finfo(self.dtype)
        scaled = float(amax) * float(self.scale)
        status = None
        if not bool((self.history > 0).any()):
            pass  # no history yet: the first step's scale (1) says nothing about the tensor
        elif scaled > info.max:
            self.overflows += 1
            status = "overflow"
        elif 0 < scaled < info.tiny:
            self.underflows += 1
            status = "underflow"
        self.history = torch.cat([amax.reshape(1).float(), self.history[:-1]])
        self.current = torch.zeros_like(self.current)
        self.update_scale()
        return status

    def update_scale(self) -> None:
        window = self.history[:1] if self.algo == "most_recent" else self.history
        self.scale = scale_from_amax(window.amax(), self.dtype, self.margin)

    def load(self, history: torch.Tensor) -> None:
        """Restore a saved history (a resume) and the scale it gives. A saved history of
        another length keeps its newest entries (or is padded with zeros)."""
        n = self.history.numel()
        h = history.reshape(-1).float().to(self.history.device)[:n]
        self.history = torch.cat([h, h.new_zeros(n - h.numel())])
        self.current = torch.zeros_like(self.current)
        self.update_scale()


def finish_step(histories: Iterable[AmaxHistory], groups: Sequence[Group]) -> list[str | None]:
    """Reduce every history's step amax over ``groups`` in one collective and push it;
    returns each one's :meth:`AmaxHistory.push` status."""
    hs = list(histories)
    if not hs:
        return []
    amaxes = reduce_amax(torch.stack([h.current for h in hs]), groups)
    return [h.push(a) for h, a in zip(hs, amaxes, strict=True)]
