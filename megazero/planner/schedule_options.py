"""The pipeline schedules the layout search tries: every schedule megazero runs, as choices.

One place that says, for a pipeline of ``pp`` stages of ``layers`` layers each and ``m``
micro-batches per iteration, which schedules apply and with which flags: 1F1B, and Megatron's
interleaved 1F1B with ``--num-layers-per-virtual-pipeline-stage n`` for 2-4 chunks per stage
(more chunks shrink the bubble further but add a pipeline exchange per chunk and micro-batch;
the step-time model weighs both); and the zero-bubble schedules ZB-H1, ZBV and DualPipeV
(``--pipeline-schedule``), priced by :func:`megazero.pipeline.zero_bubble.bubble_units`. A
schedule megazero gains is added here, and the search, the labels and the winner's flags
follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config.rules import (
    divisors,
    schedule_min_microbatches,
    valid_microbatch_group_sizes,
)
from megazero.pipeline.zero_bubble import ZERO_BUBBLE

#: chunks per stage the interleaved schedule is tried with
INTERLEAVED_CHUNKS = (2, 3, 4)


@dataclass(frozen=True)
class ScheduleChoice:
    """One pipeline schedule: its name and what ``pretrain_gpt.py`` is told to run it."""

    name: str
    layers_per_virtual_stage: int | None = None  # interleaved 1F1B: layers per model chunk

    @property
    def pipeline_schedule(self) -> str | None:
        """The ``--pipeline-schedule`` value (None: 1F1B or interleaved, from the layers)."""
        return self.name if self.name in ZERO_BUBBLE else None

    def chunks(self, layers_per_stage: int) -> int:
        if self.name in ZERO_BUBBLE:
            return ZERO_BUBBLE[self.name][1]
        n = self.layers_per_virtual_stage
        return 1 if n is None else layers_per_stage // n

    def flags(self) -> list[str]:
        if self.name in ZERO_BUBBLE:
            return [f"--pipeline-schedule={self.name}"]
        n = self.layers_per_virtual_stage
        return [] if n is None else [f"--num-layers-per-virtual-pipeline-stage={n}"]

    def label(self, layers_per_stage: int) -> str:
        return self.name if self.layers_per_virtual_stage is None else \
            f"{self.name} x{self.chunks(layers_per_stage)}"


ONE_F_ONE_B = ScheduleChoice("1f1b")
#: the zero-bubble schedules (the V ones need 2 x pp equal chunks: a layout the run refuses
#: is dropped by the search)
ZERO_BUBBLE_CHOICES = tuple(ScheduleChoice(n) for n in ZERO_BUBBLE)


def schedule_choices(pp: int, layers_per_stage: int) -> list[ScheduleChoice]:
    """The schedules a pipeline of ``pp`` stages can run (every micro-batch count); without a
    pipeline there is none to choose (1F1B stands for "no schedule")."""
    if pp == 1:
        return [ONE_F_ONE_B]
    zb = [c for c in ZERO_BUBBLE_CHOICES
          if ZERO_BUBBLE[c.name][1] == 1 or layers_per_stage % 2 == 0]
    return [ONE_F_ONE_B] + [ScheduleChoice("interleaved", layers_per_stage // v)
                            for v in INTERLEAVED_CHUNKS
                            if v in divisors(layers_per_stage) and layers_per_stage // v >= 1
                            ] + zb


def runs_with(choice: ScheduleChoice, pp: int, microbatches: int) -> bool:
    """Whether ``choice`` runs ``microbatches`` per iteration on ``pp`` stages with the default
    micro-batch group size (the interleaved schedule needs ``pp`` in the valid group sizes)."""
    if choice.name in ZERO_BUBBLE:
        return microbatches >= schedule_min_microbatches(choice.name, pp)
    if choice.layers_per_virtual_stage is None:
        return True
    return pp in valid_microbatch_group_sizes(pp, microbatches)
