"""One validated :class:`MegazeroConfig` per run, from Megatron flags and a DeepSpeed JSON config.

Modules:

* :mod:`~megazero.config.schema`: the frozen dataclasses, the single source of truth
  (the optimizer, precision and ZeRO sections in :mod:`~megazero.config.optim_schema`).
* :mod:`~megazero.config.rules`: one function per rule about sizes (divisibility, batch, SP),
  called by the config's validation and by the topology, partition, model, setup and planner.
* :mod:`~megazero.config.cli`: the flag table and its argparse parser (help text in
  :mod:`~megazero.config.flag_help`, other tools' spellings in
  :mod:`~megazero.config.flag_aliases`).
* :mod:`~megazero.config.deepspeed`: the table of DeepSpeed JSON keys and their checking.
* :mod:`~megazero.config.jsonc`: reading JSON files as DeepSpeed does (comments, hjson relaxations).
* :mod:`~megazero.config.parse`: a command line -> the flags it typed, every problem at once
  (Megatron-LM / Megatron-DeepSpeed script flags in :mod:`~megazero.config.script_flags`).
* :mod:`~megazero.config.merge`: flags + JSON -> ``{field: (source, value)}`` -> the dataclasses.

:func:`load_config` is the entry point of ``pretrain_gpt.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from megazero.config.cli import FLAGS, build_parser, field_default, flag_values
from megazero.config.deepspeed import DS_CONFIG_KEYS, SCHEDULER_TYPES, UnimplementedConfigWarning
from megazero.config.jsonc import load_ds_json, parse_ds_json
from megazero.config.merge import config_from_dict
from megazero.config.model_schema import ModelConfig, check_tensor_parallel_split
from megazero.config.optim_schema import (
    AioConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
)
from megazero.config.parse import parse_args, parse_args_collecting
from megazero.config.rules import check_microbatch_groups, valid_microbatch_group_sizes
from megazero.config.schema import MegazeroConfig, validate
from megazero.config.sections import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    RecomputeConfig,
    TrainConfig,
)
from megazero.errors import ConfigError

__all__ = [
    "DS_CONFIG_KEYS", "FLAGS", "SCHEDULER_TYPES", "AioConfig", "CheckpointConfig", "ConfigError",
    "DataConfig", "LoggingConfig", "MegazeroConfig", "ModelConfig", "OffloadConfig",
    "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "RecomputeConfig", "TrainConfig",
    "UnimplementedConfigWarning", "ZeroConfig", "build_parser", "check_microbatch_groups",
    "check_tensor_parallel_split", "config_from_dict", "field_default", "flag_values",
    "load_config", "load_ds_json", "parse_args", "parse_ds_json", "valid_microbatch_group_sizes",
    "validate",
]


def load_config(argv: Sequence[str] | None, world_size: int | None = None,
                ds_config: dict[str, Any] | None = None) -> MegazeroConfig:
    """Parse ``argv``, read ``--deepspeed_config`` (or take ``ds_config``), merge, validate.

    ``argv`` None means ``sys.argv[1:]``. ``world_size`` is the number of processes (None:
    torchrun's ``WORLD_SIZE`` variable, else 1); the data-parallel size is
    ``world_size / (tp * pp)``.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args, problems = parse_args_collecting(sys.argv[1:] if argv is None else argv)
    path = getattr(args, "deepspeed_config", None)
    if path is not None and ds_config is not None:
        raise ConfigError("give the DeepSpeed config either as --deepspeed_config or as a dict, "
                          "not both")
    if path is not None:
        try:
            ds_config = load_ds_json(path)
        except ConfigError as e:  # named with the command line's other problems
            problems.append(str(e))
    # every problem of the command line, and each flag that contradicts the JSON, in one error
    return config_from_dict(ds_config, args, world_size, pending=problems)
