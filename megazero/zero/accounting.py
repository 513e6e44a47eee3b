"""Bytes held for model states, by kind and by placement, counted from real tensor storage.

Each tensor is charged to a *kind* (``params``, ``grads``, ``optimizer``: fp32 master weights
and moments) and a *placement*: ``device`` (where the model computes; ``cpu`` in a CPU-only run)
or ``offload`` (host memory used by ``offload_optimizer`` / ``offload_param``). Storage shared by
several tensors (views of one flat buffer, fp32 master weights that *are* the parameters) is
counted once, for the first kind that claims it, so the totals are what the allocator holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("params", "grads", "optimizer")
PLACES = ("device", "offload")


@dataclass
class MemoryReport:
    """``bytes[kind][place]`` plus totals; ``padding_elements`` is what alignment added."""

    bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: {k: {p: 0 for p in PLACES} for k in KINDS})
    padding_elements: int = 0
    device_type: str = "cpu"

    def total(self, place: str | None = None) -> int:
        return sum(v for k in KINDS for p, v in self.bytes[k].items()
                   if place is None or p == place)

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "device_total": self.total("device"),
                "offload_total": self.total("offload"), "total": self.total(),
                "padding_elements": self.padding_elements, "device_type": self.device_type,
                "note": "storage bytes of model states only (no activations); 'device' is the "
                        f"model's device ({self.device_type}), 'offload' is host memory"}


class StorageCounter:
    """Adds tensors to a :class:`MemoryReport`, counting each storage once."""

    def __init__(self, report: MemoryReport) -> None:
        self.report = report
        self._seen: set[int] = set()

    def add(self, kind: str, tensors: Iterable[torch.Tensor | None], place: str = "device"
            ) -> None:
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            nbytes = storage.nbytes()
            if nbytes == 0 or ptr in self._seen:
                continue
            self._seen.add(ptr)
            self.report.bytes[kind][place] += nbytes


def formula_comm_bytes(stage: int, numel: int, dp: int, elem_size: int) -> float:
    """Data-parallel bytes moved per rank per step with ring collectives."""
    factor = 3 if stage == 3 else 2
    return factor * numel * (dp - 1) / dp * elem_size
