"""Learning-rate schedules: Megatron's ``--lr-decay-style`` and DeepSpeed's ``scheduler`` block.

Both families are pure functions of the number of optimizer steps already taken, so a schedule
resumes exactly from the step count stored in a checkpoint. :class:`LRScheduler` applies the
value to the optimizer's ``param_groups`` (every group gets the same learning rate; a group may
carry an ``lr_mult`` that scales it, as Megatron allows).

Timing follows each original so results match runs of the tools users come from:

* Megatron (``OptimizerParamScheduler``): the step ``k`` (0-based) uses ``lr(k)``; with warm-up
  the first step runs at ``lr * 0 / warmup``. After ``lr_decay_iters`` the rate stays at
  ``min_lr``.
* DeepSpeed (``WarmupLR`` and friends): the scheduler starts at ``last_batch_iteration = -1``
  and is stepped *after* each optimizer step, so step ``k`` uses ``f(k - 1)``; ``f(-1)`` is the
  warm-up minimum (``WarmupLR``, ``WarmupDecayLR``) or 0 (``WarmupCosineLR``).
* Megatron-DeepSpeed's token schedule (``--lr-warmup-tokens``, ``--lr-decay-tokens``): the same
  shapes over the tokens consumed instead of the steps taken (:class:`MegatronSchedule`). The
  step ``k`` uses the tokens of the ``k`` steps before it, as step-counted schedules use ``k``
  (Megatron-DeepSpeed itself passes the count of one step earlier). Warm-up counted in steps with
  decay counted in tokens starts the decay at the tokens the warm-up consumed, as there.
* Megatron's ``--decoupled-lr``: parameter groups marked ``decoupled`` (the input embedding and
  output layer) follow the same schedule between their own peak and minimum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from megazero.config import ConfigError, OptimizerConfig
from megazero.config.deepspeed import SCHEDULER_TYPES

#: the DeepSpeed scheduler types megazero implements (the key table says which)
DEEPSPEED_SCHEDULERS = tuple(kind for kind, (done, _, _) in SCHEDULER_TYPES.items() if done)
MEGATRON_STYLES = ("constant", "linear", "cosine")


def megatron_lr(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                style: str) -> float:
    """Megatron's learning rate at ``step`` optimizer steps taken (warm-up starts from 0)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    span = decay_steps - warmup_steps
    return _decayed(max_lr, min_lr, (step - warmup_steps) / span if span > 0 else 1.0, style)


@dataclass(frozen=True)
class MegatronSchedule:
    """Megatron's ``--lr-decay-style`` schedule as a value: ``schedule(steps, tokens)``. The
    warm-up is counted in tokens when ``warmup_tokens`` is set, the decay when
    ``decay_tokens`` is (Megatron-DeepSpeed's meaning), else both in optimizer steps."""

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    style: str
    warmup_tokens: int | None = None
    decay_tokens: int | None = None

    def __call__(self, step: int, tokens: int = 0) -> float:
        if self.warmup_tokens is None and self.decay_tokens is None:
            return megatron_lr(step, self.max_lr, self.min_lr, self.warmup_steps,
                               self.decay_steps, self.style)
        if self.warmup_tokens is None:  # warm-up in steps, decay in tokens
            if self.warmup_steps > 0 and step <= self.warmup_steps:
                return self.max_lr * step / self.warmup_steps
        elif self.warmup_tokens > 0 and tokens <= self.warmup_tokens:
            return self.max_lr * tokens / self.warmup_tokens
        if self.style == "constant":
            return self.max_lr
        if self.decay_tokens is None:  # warm-up in tokens, decay in steps
            return megatron_lr(step, self.max_lr, self.min_lr, 0, self.decay_steps, self.style)
        if tokens > self.decay_tokens:
            return self.min_lr
        start = self.warmup_tokens or 0
        span = self.decay_tokens - start
        return _decayed(self.max_lr, self.min_lr, (tokens - start) / span if span > 0 else 1.0,
                        self.style)


def _decayed(max_lr: float, min_lr: float, ratio: float, style: str) -> float:
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ConfigError(f"--lr-decay-style {style!r}: expected one of {MEGATRON_STYLES}")
    return min_lr + coeff * (max_lr - min_lr)


def _warmup_gamma(it: int, warmup: int, warmup_type: str) -> float:
    """DeepSpeed's warm-up fraction at ``last_batch_iteration = it`` (``it < warmup``)."""
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup)
    return it / warmup


def warmup_lr(it: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
              warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """DeepSpeed ``WarmupLR`` at ``last_batch_iteration = it``: warm up, then hold the max."""
    warmup = max(2, warmup_num_steps)
    if it < 0:
        return warmup_min_lr
    gamma = _warmup_gamma(it, warmup, warmup_type) if it < warmup else 1.0
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_decay_lr(it: int, total_num_steps: int, warmup_min_lr: float = 0.0,
                    warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                    warmup_type: str = "log") -> float:
    """DeepSpeed ``WarmupDecayLR``: ``WarmupLR``, then linear decay to 0 at ``total_num_steps``."""
    warmup = max(2, warmup_num_steps)
    if it < 0:
        return warmup_min_lr
    if it < warmup:
        gamma = _warmup_gamma(it, warmup, warmup_type)
    else:
        gamma = max(0.0, (total_num_steps - it) / max(1.0, total_num_steps - warmup))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_cosine_lr(it: int, base_lr: float, total_num_steps: int,
                     warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                     cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> float:
    """DeepSpeed ``WarmupCosineLR``: a ratio of the optimizer's base lr (``--lr``)."""
    warmup = max(2, warmup_num_steps)
    if it < 0:
        return 0.0
    if it < warmup:
        ratio = _warmup_gamma(it, warmup, warmup_type)
        return base_lr * (warmup_min_ratio + ratio * (1.0 - warmup_min_ratio))
    real_step = it - warmup + 1
    real_total = total_num_steps - warmup
    ratio = (1 + math.cos(math.pi * real_step / real_total)) / 2
    return base_lr * max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ratio)


def build_lr_function(config: OptimizerConfig, train_iters: int | None,
                      tokens_at: Callable[[int], int] | None = None) -> Callable[..., float]:
    """``f(step) -> lr`` for the configured schedule; ``step`` = optimizer steps already taken.
    Megatron's styles give a :class:`MegatronSchedule` (``f(step, tokens)``); ``tokens_at(k)``
    (the tokens the first ``k`` steps consume) places a step-counted warm-up's end on the token
    axis when the decay is counted in tokens."""
    if config.scheduler_type:
        kind = config.scheduler_type
        if kind not in DEEPSPEED_SCHEDULERS:
            raise ConfigError(f"scheduler.type {kind!r} is not supported; expected one of "
                              f"{DEEPSPEED_SCHEDULERS}")
        params: dict[str, Any] = dict(config.scheduler_params)
        allowed = set(SCHEDULER_TYPES[kind][1])
        unknown = set(params) - allowed
        if unknown:
            raise ConfigError(f"scheduler.params for {kind}: unknown keys {sorted(unknown)}; "
                              f"expected some of {sorted(allowed)}")
        start = int(params.pop("last_batch_iteration", -1))
        if params.get("warmup_type", "log") not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type {params['warmup_type']!r}: expected "
                              "'log' or 'linear'")
        if kind != "WarmupLR" and "total_num_steps" not in params:
            if not train_iters:
                raise ConfigError(f"scheduler {kind} needs params.total_num_steps (or "
                                  "--train-iters to derive it)")
            params["total_num_steps"] = train_iters
        if kind == "WarmupLR":
            fn: Callable[[int], float] = lambda it: warmup_lr(it, **params)
        elif kind == "WarmupDecayLR":
            fn = lambda it: warmup_decay_lr(it, **params)
        else:
            fn = lambda it: warmup_cosine_lr(it, config.lr, **params)
        return lambda step: fn(start + step)
    style = config.lr_decay_style
    if style not in MEGATRON_STYLES:
        raise ConfigError(f"--lr-decay-style {style!r}: expected one of {MEGATRON_STYLES}")
    decay = config.lr_decay_iters or train_iters or 0
    if style != "constant" and decay <= 0:
        raise ConfigError(f"--lr-decay-style {style} needs --lr-decay-iters or --train-iters")
    if style != "constant" and config.lr_warmup_iters > decay:
        raise ConfigError(f"--lr-warmup-iters {config.lr_warmup_iters} exceeds --lr-decay-iters "
                          f"{decay}; warm-up must end before decay does")
    warmup_tokens = config.lr_warmup_tokens
    if config.lr_decay_tokens is not None:
        if warmup_tokens is None and config.lr_warmup_iters > 0:
            if tokens_at is None:
                raise ConfigError("--lr-decay-tokens with a warm-up in iterations needs the "
                                  "tokens per step; give --lr-warmup-tokens instead")
            warmup_tokens = tokens_at(config.lr_warmup_iters)
        if (warmup_tokens or 0) > config.lr_decay_tokens:
            raise ConfigError(f"the warm-up ({warmup_tokens} tokens) ends after "
                              f"--lr-decay-tokens {config.lr_decay_tokens}; warm-up must end "
                              "before decay does")
    return MegatronSchedule(config.lr, config.min_lr, config.lr_warmup_iters, decay, style,
                            warmup_tokens, config.lr_decay_tokens)


def decoupled_schedule(config: OptimizerConfig, schedule: Callable[..., float]
                       ) -> MegatronSchedule | None:
    """``--decoupled-lr``'s schedule: ``schedule``'s shape between the decoupled peak and
    minimum (default ``--min-lr``), or None without the flag."""
    if config.decoupled_lr is None:
        return None
    if not isinstance(schedule, MegatronSchedule):
        raise ConfigError(f"--decoupled-lr {config.decoupled_lr} follows --lr-decay-style; the "
                          f"DeepSpeed config's scheduler {config.scheduler_type!r} has no "
                          "decoupled rate: drop one of them")
    low = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
    return replace(schedule, max_lr=config.decoupled_lr, min_lr=low)


class LRScheduler:
    """Sets the learning rate of an optimizer's ``param_groups`` from a schedule and step count.

    ``num_steps`` counts optimizer updates taken; :meth:`step` advances it after each update
    that was applied. A step skipped by the fp16 loss scaler does not advance it (Megatron and
    DeepSpeed both hold the schedule on overflow).

    ``optimizer`` is anything with a ``param_groups`` attribute (or a plain list of groups).
    The attribute is read on every update, never cached: ``torch.optim.Optimizer.load_state_dict``
    replaces the group list, and a scheduler holding the old list would silently stop steering
    the learning rate after a checkpoint is loaded.

    ``num_tokens`` (tokens consumed) feeds a token-counted :class:`MegatronSchedule`; groups
    marked ``decoupled`` follow ``decoupled`` when given (Megatron's ``--decoupled-lr``).
    """

    def __init__(self, optimizer: Any, lr_fn: Callable[..., float],
                 num_steps: int = 0, decoupled: MegatronSchedule | None = None) -> None:
        self.optimizer = optimizer
        self.lr_fn = lr_fn
        self.decoupled = decoupled
        self.num_steps = int(num_steps)
        self.num_tokens = 0
        self._apply()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups = getattr(self.optimizer, "param_groups", self.optimizer)
        return list(groups)

    @classmethod
    def from_config(cls, optimizer: Any, config: OptimizerConfig,
                    train_iters: int | None) -> LRScheduler:
        return cls(optimizer, build_lr_function(config, train_iters))

    def _at(self, fn: Callable[..., float]) -> float:
        if isinstance(fn, MegatronSchedule):
            return fn(self.num_steps, self.num_tokens)
        return fn(self.num_steps)

    def get_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self._at(self.lr_fn)

    def get_decoupled_lr(self) -> float | None:
        """The next step's rate of the ``decoupled`` groups, or None without them."""
        return None if self.decoupled is None else self._at(self.decoupled)

    def _apply(self) -> None:
        lr, decoupled = self.get_lr(), self.get_decoupled_lr()
        for group in self.param_groups:
            own = decoupled if group.get("decoupled") and decoupled is not None else lr
            group["lr"] = own * group.get("lr_mult", 1.0)

    def step(self, increment: int = 1, tokens: int | None = None) -> None:
        """After an applied update: ``increment`` more steps taken; ``tokens``: the tokens
        consumed so far (a step skipped by the loss scaler consumed its tokens too)."""
        self.num_steps += increment
        if tokens is not None:
            self.num_tokens = int(tokens)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self.num_tokens = int(state.get("num_tokens", 0))  # checkpoints before token schedules
        self._apply()
