"""Loss scaling for fp16 training: static or dynamic, with DeepSpeed's config semantics.

Dynamic rule (``fp16.loss_scale == 0``), evaluated once per optimizer step:

* overflow: if the hysteresis budget is spent (``hysteresis`` overflows in a row, or one when
  ``hysteresis == 1``), the scale is halved (never below ``min_loss_scale``); otherwise one unit
  of hysteresis is used up and the scale stays. The step is skipped either way.
* clean step: with ``consecutive_hysteresis`` the hysteresis budget refills on every clean step;
  after ``loss_scale_window`` clean steps since the last overflow the scale doubles (and the
  budget refills).

An overflow while the scale already sits at ``min_loss_scale`` with no hysteresis left raises
:class:`LossScaleError`: the run cannot make progress, and skipping steps forever would hide it.
"""

from __future__ import annotations

from typing import Any

from megazero.config import PrecisionConfig
from megazero.errors import MegazeroError


class LossScaleError(MegazeroError, RuntimeError):
    """Gradients still overflow at the minimum loss scale."""


class LossScaler:
    """Static scale (``dynamic=False``) or the dynamic state machine described above."""

    def __init__(self, init_scale: float = 1.0, dynamic: bool = False, window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 min_scale: float = 1.0, factor: float = 2.0) -> None:
        self.scale = float(init_scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.factor = factor
        self.cur_hysteresis = hysteresis
        self.iteration = 0
        self.last_overflow = -1

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> LossScaler:
        if not cfg.fp16:
            return cls(1.0, dynamic=False)
        if cfg.loss_scale and cfg.loss_scale > 0:
            return cls(cfg.loss_scale, dynamic=False)
        return cls(2.0 ** cfg.initial_scale_power, dynamic=True, window=cfg.loss_scale_window,
                   hysteresis=cfg.hysteresis, consecutive_hysteresis=cfg.consecutive_hysteresis,
                   min_scale=cfg.min_loss_scale)

    def update(self, overflow: bool) -> None:
        """Advance the state machine after one step (``overflow``: the step was skipped)."""
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis <= 1:
                if self.scale <= self.min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflow at the minimum loss scale "
                        f"(fp16.min_loss_scale = {self.min_scale:g}) at step {self.iteration}; "
                        f"training cannot progress. Lower fp16.min_loss_scale, lower the "
                        f"learning rate, or use bf16")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.iteration - self.last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis,
                "iteration": self.iteration, "last_overflow": self.last_overflow,
                "dynamic": self.dynamic}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])
        self.iteration = int(sd["iteration"])
        self.last_overflow = int(sd["last_overflow"])
