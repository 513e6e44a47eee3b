"""Settings the merge derives once the sections are built: the warm-up and decay lengths given
in samples or as a fraction turned into iterations, the saved-input settings that have nothing
to act on turned off (each with one warning), and the JSON's ``"auto"`` values filled with what
the run will use. Kept apart from :mod:`megazero.config.merge`, which decides where each value
comes from.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from megazero.config.deepspeed import DS_CONFIG_KEYS
from megazero.config.schema import MegazeroConfig
from megazero.config.sections import ParallelConfig
from megazero.errors import ConfigError


def schedule_lengths(cfg: MegazeroConfig, given: set[str]) -> MegazeroConfig:
    """Megatron's other ways to give the warm-up and decay lengths, turned into iterations:
    ``--lr-warmup-fraction`` (of the decay steps) and ``--lr-warmup-samples`` /
    ``--lr-decay-samples`` (divided by the global batch, which must divide them)."""
    o, t = cfg.optimizer, cfg.train
    warmups = [n for n, f in (("--lr-warmup-iters", "optimizer.lr_warmup_iters"),
                              ("--lr-warmup-fraction", "optimizer.lr_warmup_fraction"),
                              ("--lr-warmup-samples", "optimizer.lr_warmup_samples"),
                              ("--lr-warmup-tokens", "optimizer.lr_warmup_tokens"))
               if f in given]
    if len(warmups) > 1:
        raise ConfigError(f"{' and '.join(warmups)} all set the warm-up length; give one of them")
    decays = [n for n, f in (("--lr-decay-iters", "optimizer.lr_decay_iters"),
                             ("--lr-decay-samples", "optimizer.lr_decay_samples"),
                             ("--lr-decay-tokens", "optimizer.lr_decay_tokens")) if f in given]
    if len(decays) > 1:
        raise ConfigError(f"{' and '.join(decays)} all set the decay length; give one of them")
    if (o.lr_warmup_tokens is not None or o.lr_decay_tokens is not None) and o.scheduler_type:
        raise ConfigError(f"--lr-warmup-tokens / --lr-decay-tokens schedule Megatron's "
                          f"--lr-decay-style; the DeepSpeed config's scheduler "
                          f"{o.scheduler_type!r} counts steps: drop one of them")
    gbs = t.global_batch_size
    assert gbs is not None  # the batch triad is filled in before the schedule lengths

    def iters(flag: str, samples: int) -> int:
        if samples < 0 or samples % gbs:
            raise ConfigError(f"{flag} {samples} is not a multiple of the global batch size "
                              f"{gbs}; use a multiple (e.g. {max(gbs, samples - samples % gbs)})")
        return samples // gbs

    kw: dict[str, Any] = {}
    if o.lr_decay_samples is not None:
        kw["lr_decay_iters"] = iters("--lr-decay-samples", o.lr_decay_samples)
    if o.lr_warmup_samples is not None:
        kw["lr_warmup_iters"] = iters("--lr-warmup-samples", o.lr_warmup_samples)
    if o.lr_warmup_fraction is not None:
        if not 0.0 <= o.lr_warmup_fraction <= 1.0:
            raise ConfigError(f"--lr-warmup-fraction {o.lr_warmup_fraction}: expected a "
                              f"fraction between 0 and 1")
        decay = kw.get("lr_decay_iters", o.lr_decay_iters) or t.train_iters or (
            t.train_samples // gbs if t.train_samples else None)
        if decay is None:
            raise ConfigError("--lr-warmup-fraction needs the decay length: give --train-iters "
                              "or --lr-decay-iters")
        kw["lr_warmup_iters"] = int(o.lr_warmup_fraction * decay)
    return replace(cfg, optimizer=replace(o, **kw)) if kw else cfg


def saved_inputs_in_effect(parallel: ParallelConfig) -> ParallelConfig:
    """Turn off (with one warning each) the saved-input settings that have nothing to act on:
    both need full recomputation (only its layer groups keep an input); distributing needs
    tensor parallelism without sequence parallelism (with it the input is already split)."""
    full = parallel.recompute_granularity == "full"
    distribute, offload = parallel.distribute_saved_activations, parallel.cpu_checkpointing
    why = None
    if distribute and not full:
        why = "needs --recompute-granularity full"
    elif distribute and parallel.tp == 1:
        why = "has nothing to distribute at --tensor-model-parallel-size 1"
    elif distribute and parallel.sequence_parallel:
        why = ("has nothing to distribute with --sequence-parallel (each tensor-parallel rank "
               "already keeps 1/tp of the input)")
    if why:
        warnings.warn(f"--distribute-saved-activations (activation_checkpointing."
                      f"partition_activations) {why}; turning it off", UserWarning, stacklevel=3)
        parallel = replace(parallel, distribute_saved_activations=False)
    if offload and not full:
        warnings.warn("activation_checkpointing.cpu_checkpointing needs --recompute-granularity "
                      "full (it moves the inputs full recomputation keeps); turning it off",
                      UserWarning, stacklevel=3)
        parallel = replace(parallel, cpu_checkpointing=False)
    return parallel


def fill_auto(ds: dict[str, Any], cfg: MegazeroConfig, parent: str = "") -> dict[str, Any]:
    """``ds`` with each ``"auto"`` replaced by the value the run will use."""
    out: dict[str, Any] = {}
    for name, value in ds.items():
        path = f"{parent}.{name}" if parent else name
        key = DS_CONFIG_KEYS[path]
        if isinstance(value, dict) and key.kind == "block":
            out[name] = fill_auto(value, cfg, path)
        elif value != "auto":
            out[name] = value
        elif isinstance(key.field, tuple):
            out[name] = [_get(cfg, f) for f in key.field]
        elif path == "scheduler.params.total_num_steps":
            total = cfg.optimizer.lr_decay_iters or cfg.train.train_iters
            if total is None:
                raise ConfigError('scheduler.params.total_num_steps is "auto" but neither '
                                  '--lr-decay-iters nor --train-iters is given; give one of them')
            out[name] = total
        elif path == "scheduler.params.cos_min_ratio":
            out[name] = cfg.optimizer.min_lr / cfg.optimizer.lr if cfg.optimizer.lr else 0.0
        elif path == "scheduler.params.warmup_min_lr":
            # WarmupDecayLR ends at warmup_min_lr: the decay's floor is --min-lr (default 0)
            out[name] = cfg.optimizer.min_lr
        elif path == "scheduler.params.warmup_min_ratio":
            out[name] = 0.0  # Megatron's warm-up starts from zero
        elif path == "tensorboard.enabled":
            out[name] = cfg.logging.tensorboard_dir is not None
        elif key.field is not None:
            out[name] = _get(cfg, key.field)
        else:
            out[name] = key.default
    return out


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg
