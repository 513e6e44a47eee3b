"""The engine's configuration: a DeepSpeed JSON config (a dict, a file path, or
``args.deepspeed_config``) turned into one validated :class:`~megazero.config.MegazeroConfig`.

The JSON goes through the same reader (hjson relaxations, ``//`` comments) and the same key
table, merge and batch-triad rule as ``pretrain_gpt.py --deepspeed_config``; ``"auto"`` members
of the triad are derived from the others and the data-parallel size (the whole world here: the
engine runs tp = pp = 1). Where megazero's command-line defaults differ from DeepSpeed's for a
key the JSON leaves out, the engine takes DeepSpeed's (:data:`DS_DEFAULTS`), so a config means
what it means under DeepSpeed.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from megazero.config import ConfigError, MegazeroConfig
from megazero.config.deepspeed import SCHEDULER_TYPES, get_path
from megazero.config.jsonc import load_ds_json
from megazero.optim.lr_scheduler import DEEPSPEED_SCHEDULERS

#: JSON key absent -> DeepSpeed's value (megazero's CLI defaults follow Megatron instead).
#: (JSON keys that set the field, the OptimizerConfig field, DeepSpeed's default)
DS_DEFAULTS: tuple[tuple[tuple[str, ...], str, Any], ...] = (
    (("gradient_clipping",), "clip_grad", 0.0),
    (("optimizer.params.weight_decay",), "weight_decay", 0.0),
    (("optimizer.params.lr", "scheduler.params.warmup_max_lr"), "lr", 1e-3),
    (("optimizer.params.momentum",), "sgd_momentum", 0.0),  # torch.optim.SGD's
)


def _config_source(args: Any, config: Any, config_params: Any) -> tuple[Any, str]:
    given = []
    if config is not None:
        given.append((config, "config="))
    if config_params is not None:
        given.append((config_params, "config_params="))
    for name in ("deepspeed_config", "deepscale_config"):
        path = getattr(args, name, None) if args is not None else None
        if path is not None:
            given.append((path, f"args.{name}"))
    if not given:
        raise ConfigError("megazero.initialize needs a DeepSpeed config: pass config= (a dict or "
                          "a JSON file path) or args with args.deepspeed_config")
    if len(given) > 1:
        raise ConfigError(f"the config is given twice ({' and '.join(w for _, w in given)}); "
                          "pass exactly one of them")
    return given[0]


def load_engine_config(args: Any, config: Any, config_params: Any,
                       world_size: int) -> MegazeroConfig:
    """The run's config from whichever source was given (exactly one)."""
    from megazero.config.merge import config_from_dict

    source, where = _config_source(args, config, config_params)
    if isinstance(source, (str, os.PathLike)):
        ds = load_ds_json(source)
    elif isinstance(source, dict):
        ds = source
    else:
        raise ConfigError(f"{where} must be a dict or a path to a JSON file, got "
                          f"{type(source).__name__}")
    cfg = config_from_dict(ds, {}, world_size)
    kind = get_path(ds, "scheduler.type")
    if kind is not None and not SCHEDULER_TYPES.get(kind, (False,))[0]:
        raise ConfigError(f"scheduler.type {kind!r} is not supported by the megazero engine; "
                          f"use one of {', '.join(DEEPSPEED_SCHEDULERS)}, or pass lr_scheduler= to "
                          "megazero.initialize")
    opt = cfg.optimizer
    changes = {fld: value for paths, fld, value in DS_DEFAULTS
               if all(get_path(ds, p) in (None, "auto") for p in paths)}
    if changes:
        cfg = replace(cfg, optimizer=replace(opt, **changes))
    return cfg


def has_optimizer_block(cfg: MegazeroConfig) -> bool:
    return cfg.optimizer.from_ds_config


def has_scheduler_block(cfg: MegazeroConfig) -> bool:
    """A scheduler block of an unimplemented type is refused by :func:`load_engine_config`."""
    return cfg.optimizer.scheduler_type is not None
