"""Memory after forward, after backward and after the optimizer step (``--log-memory-phases``).

The training loop creates one :class:`MemoryPhases` per iteration when the flag is on; the
monitor writes the three values as TensorBoard / JSON scalars ``mem-after-forward``,
``mem-after-backward``, ``mem-after-step`` (bytes) with the next log line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megazero.pipeline.activation_meter import ActivationMeter

if TYPE_CHECKING:
    from megazero.zero.optimizer import ZeroOptimizer


class MemoryPhases:
    """``--log-memory-phases``: bytes held after forward, after backward, after the step.

    CUDA: ``after forward`` is the allocator's peak during the schedule (the moment the most
    forwards are in flight), the other two ``memory_allocated()``. CPU has no allocator
    statistics, so the bytes are *tracked tensor bytes*: the engine's model-state storage
    (``engine.memory_report()`` device total) plus, after forward, the peak bytes of tensors
    autograd saved for backward (the pipeline executor's activation meter).
    """

    def __init__(self, engine: ZeroOptimizer, device: torch.device) -> None:
        self.engine, self.cuda = engine, device.type == "cuda"
        self.meter = ActivationMeter()
        self.phases: dict[str, float] = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def _now(self) -> float:
        if self.cuda:
            return float(torch.cuda.memory_allocated())
        return float(self.engine.memory_report()["device_total"])

    def after_backward(self) -> None:
        now = self._now()
        self.phases["mem-after-forward"] = (
            float(torch.cuda.max_memory_allocated()) if self.cuda
            else now + float(self.meter.peak_saved_bytes))
        self.phases["mem-after-backward"] = now

    def after_step(self) -> dict[str, float]:
        self.phases["mem-after-step"] = self._now()
        return self.phases
