"""Merging command-line flags and a DeepSpeed JSON config into one :class:`MegazeroConfig`.

Rules, in order:

1. Every JSON key is checked against :data:`~megazero.config.deepspeed.DS_CONFIG_KEYS` (unknown key,
   wrong type: error; known but not implemented: one warning per key).
2. A flag typed on the command line and a JSON value (not ``"auto"``) for the same field must
   agree; two JSON keys for one field (``optimizer.params.lr`` and
   ``scheduler.params.warmup_max_lr``) must agree too. ``"auto"`` and absent keys take the flag,
   else the dataclass default.
3. The batch triad ``train_batch_size = micro x gradient_accumulation_steps x dp_size`` is derived
   or checked, with ``dp_size = world_size / (tp * pp)``.
4. The dataclasses are built (each validates itself, :func:`megazero.config.validate` checks
   across them); they are the only copy of the settings (the scheduler's ``params`` are kept
   with every ``"auto"`` filled in, as :mod:`megazero.optim.lr_scheduler` reads them).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from megazero.config.cli import flag_values
from megazero.config.deepspeed import (
    ADAM_ONLY_PARAMS,
    LAMB_ONLY_PARAMS,
    ONEBIT_ONLY_PARAMS,
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    SGD_ONLY_PARAMS,
    UnimplementedConfigWarning,
    check_ds_config,
    get_path,
    json_field_values,
)
from megazero.config.derived import fill_auto, saved_inputs_in_effect, schedule_lengths
from megazero.config.model_schema import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.config.optim_schema import (
    AioConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
    nccl_zero_defaults,
)
from megazero.config.parse import raise_problems
from megazero.config.rules import num_microbatches
from megazero.config.schema import MegazeroConfig
from megazero.config.script_flags import script_notes
from megazero.config.sections import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    TrainConfig,
)
from megazero.errors import ConfigError

_SECTIONS: dict[str, Callable[..., Any]] = {
    "model": ModelConfig, "parallel": ParallelConfig, "optimizer": OptimizerConfig,
    "precision": PrecisionConfig, "data": DataConfig, "train": TrainConfig,
    "logging": LoggingConfig, "checkpoint": CheckpointConfig}
_MICRO, _GLOBAL, _GAS = ("train.micro_batch_size", "train.global_batch_size",
                         "train.gradient_accumulation_steps")

#: "auto" ZeRO-3 sizes that depend on the model, as Hugging Face's integration fills them.
_AUTO_FROM_HIDDEN: dict[str, Callable[[int], int]] = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return bool(a == b)


def _js(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool | int | float | str | None) else repr(value)


def _check_optimizer_params(ds: dict[str, Any], opt_type: str) -> None:
    """Params of the other optimizer family are refused, as its torch optimizer would."""
    params = get_path(ds, "optimizer.params") or {}
    lion = (*SGD_ONLY_PARAMS, *(k for k in ADAM_ONLY_PARAMS if k != "betas"))
    foreign = {"sgd": ADAM_ONLY_PARAMS, "lion": lion}.get(opt_type.lower(), SGD_ONLY_PARAMS)
    if "lamb" not in opt_type.lower():
        foreign = (*foreign, *LAMB_ONLY_PARAMS)
    wrong = [k for k in foreign if k in params]
    if wrong:
        owner = ("SGD" if wrong[0] in SGD_ONLY_PARAMS else "Lamb"
                 if wrong[0] in LAMB_ONLY_PARAMS else "Adam / AdamW")
        raise ConfigError(f"optimizer.params.{wrong[0]} is not a parameter of optimizer.type "
                          f"{opt_type!r}; remove it, or set the type that takes it ({owner})")
    if params.get("bias_correction") is False and opt_type.lower() not in (
            "lamb", "onebitadam", "zerooneadam", "onebitlamb"):
        raise ConfigError(f"optimizer.params.bias_correction false: megazero's {opt_type} "
                          "always applies Adam's bias corrections; remove the key (only Lamb "
                          "and OneBitAdam run without them)")


def _json_semantics(ds: dict[str, Any], found: dict[str, list[tuple[str, Any]]]) -> None:
    """Keys whose meaning is more than "copy into a field": optimizer/scheduler type, monitors."""
    opt_type = get_path(ds, "optimizer.type")
    if opt_type not in (None, "auto"):
        if opt_type.lower() not in OPTIMIZER_TYPES:
            close = difflib.get_close_matches(
                opt_type, ["Adam", "AdamW", "SGD", "Lion", "Lamb", "OneBitAdam", "ZeroOneAdam",
                           "OneBitLamb"], n=1)
            raise ConfigError(f"optimizer.type: got {opt_type!r}; megazero supports Adam, AdamW, "
                              "SGD, Lion, Lamb, OneBitAdam, ZeroOneAdam and OneBitLamb"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
        if not OPTIMIZER_TYPES[opt_type.lower()]:
            raise ConfigError(f"optimizer.type {opt_type!r} is not implemented in megazero yet; "
                              "use OneBitAdam or ZeroOneAdam (ZeRO stage 0), or Lamb")
        _check_optimizer_params(ds, opt_type)
        # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false
        w_mode = get_path(ds, "optimizer.params.adam_w_mode")
        decoupled = opt_type.lower() == "adamw" or w_mode in (None, True, "auto")
        kind = (opt_type.lower() if opt_type.lower() in ("sgd", "lion", "lamb", "onebitadam",
                                                         "zerooneadam", "onebitlamb")
                else "adamw" if decoupled else "adam")
        found["optimizer.optimizer"] = [("optimizer.type", kind)]
        if kind == "lion" and get_path(ds, "optimizer.params.betas") in (None, "auto"):
            found["optimizer.adam_beta2"] = [("optimizer.type 'Lion' (betas default)", 0.99)]
    if "optimizer" in ds:
        found["optimizer.from_ds_config"] = [("optimizer", True)]
    sched = ds.get("scheduler")
    found.pop("optimizer.scheduler_type", None)
    if sched is not None:
        kind = sched.get("type")
        if kind not in SCHEDULER_TYPES:
            close = difflib.get_close_matches(str(kind), list(SCHEDULER_TYPES), n=1)
            raise ConfigError(f"scheduler.type: got {_js(kind)}, expected one of "
                              f"{', '.join(SCHEDULER_TYPES)}"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
        implemented, allowed, style = SCHEDULER_TYPES[kind]
        for name in sched.get("params", {}):
            if name not in allowed:
                raise ConfigError(f"scheduler.params.{name} is not a parameter of {kind}; it "
                                  f"takes {', '.join(allowed)}")
        if implemented:
            found["optimizer.scheduler_type"] = [("scheduler.type", kind)]
            found["optimizer.lr_decay_style"] = [(f"scheduler.type {kind!r}", style)]
    tb = ds.get("tensorboard")
    if tb is not None and tb.get("enabled") is not True:  # false, absent or "auto"
        found.pop("logging.tensorboard_dir", None)
        found.pop("logging.tensorboard_job_name", None)
    elif tb is not None and not tb.get("output_path"):  # DeepSpeed writes under the cwd
        found["logging.tensorboard_dir"] = [("tensorboard.output_path", ".")]
    for block in ("wandb", "csv_monitor", "comms_logger", "flops_profiler"):
        if block in ds:
            found[f"logging.{block}"] = [(block, dict(ds[block]))]


def _merge(found: dict[str, list[tuple[str, Any]]], flags: dict[str, tuple[str, Any]],
           conflicts: list[str]) -> dict[str, tuple[str, Any]]:
    """field -> (source, value); two sources that disagree are added to ``conflicts`` (every
    one of them, so a launch names them all) and the flag's value is kept."""
    merged: dict[str, tuple[str, Any]] = {}
    for field in {**found, **flags}:
        sources = found.get(field, [])
        for path, value in sources[1:]:
            if not _same(value, sources[0][1]):
                conflicts.append(f"{sources[0][0]}: {_js(sources[0][1])} and {path}: "
                                 f"{_js(value)} set the same thing differently; make them "
                                 f"agree or write \"auto\" in one of them")
        if field in flags:
            flag, value = flags[field]
            if sources and not _same(value, sources[0][1]):
                shown = "" if isinstance(value, bool) else f" {_js(value)}"
                conflicts.append(f"{flag}{shown} on the command line conflicts with "
                                 f"{sources[0][0]}: {_js(sources[0][1])} in the DeepSpeed "
                                 f"config; remove one of them, make them agree, or write "
                                 f"\"auto\" in the JSON to take the flag")
            merged[field] = (flag, value)
        else:
            merged[field] = sources[0]
    return merged


def _batch_triad(merged: dict[str, tuple[str, Any]], dp: int, parallel: ParallelConfig
                 ) -> tuple[int, int, int]:
    """Derive the missing members of ``global = micro x grad_accum x dp`` and check the rest."""
    micro, gbs, gas = (merged.get(k, (None, None))[1] for k in (_MICRO, _GLOBAL, _GAS))
    where = (f"dp_size {dp} (world size {parallel.world_size} / (tp {parallel.tp} x pp "
             f"{parallel.pp}))")
    if gbs is not None and micro is None and gas is None:
        # DeepSpeed's rule for a lone train_batch_size is no accumulation; Megatron's for a lone
        # --global-batch-size is micro-batch 1. Each tool's users expect their own.
        if merged[_GLOBAL][0].startswith("--"):
            micro = 1
        else:
            gas = 1
    if gbs is None:
        micro, gas = micro or 1, gas or 1
        return micro, micro * gas * dp, gas
    for name, value in (("train_batch_size", gbs), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", gas)):
        if value is not None and value < 1:
            raise ConfigError(f"{name}: got {value}, expected a positive integer")
    if micro is not None and gas is not None:
        want = micro * gas * dp
        if gbs != want:
            alt = (f" (or gradient_accumulation_steps to {gbs // (micro * dp)})"
                   if gbs % (micro * dp) == 0 else "")
            raise ConfigError(f"batch sizes do not add up: train_batch_size {gbs} != "
                              f"train_micro_batch_size_per_gpu {micro} x "
                              f"gradient_accumulation_steps {gas} x {where} = {want}; set "
                              f"train_batch_size (--global-batch-size) to {want}{alt}")
        return micro, gbs, gas
    if micro is not None:
        name = "train_micro_batch_size_per_gpu (--micro-batch-size)"
        return micro, gbs, num_microbatches(gbs, micro, dp, micro_name=name, dp_name=where)
    assert gas is not None  # one of the two is known here
    count = num_microbatches(gbs, gas, dp, micro_name="gradient_accumulation_steps",
                             dp_name=where)
    return count, gbs, gas


def _section(name: str, merged: dict[str, tuple[str, Any]], **extra: Any) -> dict[str, Any]:
    kw = {f.split(".", 1)[1]: v for f, (_, v) in merged.items()
          if f.startswith(f"{name}.") and f.count(".") == 1}
    kw.update(extra)
    return kw


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _backend(parallel: ParallelConfig) -> str:
    """The backend the run will use: the flag, else the process group's where one exists (a
    config read inside a gloo world on a GPU machine is a CPU run's), else NCCL where CUDA is
    available (the rule of :func:`megazero.distributed.startup.choose_backend`)."""
    if parallel.distributed_backend is not None:
        return parallel.distributed_backend
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    return "nccl" if _cuda_available() else "gloo"


def config_from_dict(ds: dict[str, Any] | None, args: argparse.Namespace | dict[str, Any] | None,
                     world_size: int, pending: list[str] | None = None) -> MegazeroConfig:
    """Build the config from a DeepSpeed dict and the flags that were typed.

    ``args`` must hold only the flags given on the command line (``parse_args(argv)``, or a dict
    ``{"micro_batch_size": 4}`` keyed by argparse dest): a full namespace with defaults would make
    every default look like a typed flag and conflict with the JSON. ``pending``: problems the
    command line already had (:func:`megazero.config.parse.parse_args_collecting`); they are
    raised in one error with the flag-vs-JSON conflicts found here.
    """
    pending = list(pending or [])
    ds_checked, todo = check_ds_config(ds or {})
    for path in todo:
        shown = get_path(ds_checked, path)
        shown = "{...}" if isinstance(shown, dict) else _js(shown)
        warnings.warn(f"DeepSpeed config key {path!r} (given {shown}) is accepted but has no "
                      f"effect yet in megazero", UnimplementedConfigWarning, stacklevel=3)
    opt_type = str(get_path(ds_checked, "optimizer.type") or "").lower()
    for name in ONEBIT_ONLY_PARAMS:  # DeepSpeed's 1-bit parameters under another type
        path = f"optimizer.params.{name}"
        if opt_type not in ("onebitadam", "zerooneadam", "onebitlamb") \
                and get_path(ds_checked, path) is not None:
            warnings.warn(f"DeepSpeed config key {path!r} (given "
                          f"{_js(get_path(ds_checked, path))}) is accepted but has no effect "
                          f"with optimizer.type {opt_type or 'unset'!r} (only the 1-bit "
                          "optimizers take it)",
                          UnimplementedConfigWarning, stacklevel=3)
    kind = get_path(ds_checked, "scheduler.type")
    if kind in SCHEDULER_TYPES and not SCHEDULER_TYPES[kind][0]:
        warnings.warn(f"DeepSpeed config key 'scheduler.type' (given {kind!r}) is accepted but has "
                      f"no effect yet in megazero: the learning rate follows --lr-decay-style",
                      UnimplementedConfigWarning, stacklevel=3)
    found = json_field_values(ds_checked)
    _json_semantics(ds_checked, found)
    problems: list[str] = []  # bad flag values, flags that contradict the JSON
    flags = flag_values(args or {}, problems)
    merged = _merge(found, flags, problems)
    if pending or problems:  # with them, the first rule the rest breaks, in the same message
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _build(ds_checked, merged, flags, world_size)
        except ConfigError as e:
            problems.append(str(e))
        raise_problems([*pending, *problems], None if problems else "command line")
    return _build(ds_checked, merged, flags, world_size)


def _build(ds_checked: dict[str, Any], merged: dict[str, tuple[str, Any]],
           flags: dict[str, tuple[str, Any]], world_size: int) -> MegazeroConfig:
    """The validated dataclasses from the merged ``{field: (source, value)}``."""
    merged = dict(merged)
    if "logging.steps_per_print" in merged and "logging.log_interval" not in flags:
        # A DeepSpeed user's print interval is the log line's interval unless the flag is typed.
        merged["logging.log_interval"] = ("steps_per_print", merged["logging.steps_per_print"][1])
    if merged.get("precision.fp16", (0, False))[1] and merged.get("precision.bf16", (0, False))[1]:
        raise ConfigError(f"fp16 and bf16 are both enabled ({merged['precision.fp16'][0]} and "
                          f"{merged['precision.bf16'][0]}); enable at most one of them")

    model_kw = _section("model", merged)
    moe_kw = {f.split(".", 2)[2]: v for f, (_, v) in merged.items() if f.startswith("model.moe.")}
    if moe_kw:
        model_kw["moe"] = MoEConfig(**moe_kw)
    preset = model_kw.get("model_preset")
    model = ModelConfig.preset(preset, **model_kw) if preset else ModelConfig(**model_kw)
    parallel = ParallelConfig(**_section("parallel", merged, world_size=world_size))
    if parallel.sequence_parallel and not parallel.sequence_parallel_active:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; "
                      "turning it off", UserWarning, stacklevel=2)
        parallel = replace(parallel, sequence_parallel=False)
    parallel = saved_inputs_in_effect(parallel)
    micro, gbs, gas = _batch_triad(merged, parallel.dp, parallel)
    train = TrainConfig(**_section("train", merged, micro_batch_size=micro,
                                   global_batch_size=gbs, gradient_accumulation_steps=gas,
                                   global_batch_derived=merged.get(_GLOBAL, (0, None))[1]
                                   is None))

    zero_kw = _section("zero", merged)
    if _backend(parallel) == "nccl":  # Megatron's GPU settings where nothing set them
        zero_kw = {**nccl_zero_defaults(parallel.dp), **zero_kw}
    for path, fn in _AUTO_FROM_HIDDEN.items():
        if get_path(ds_checked, path) == "auto":
            zero_kw[path.split(".")[-1]] = fn(model.hidden_size)
    for block, cls in (("offload_optimizer", OffloadConfig), ("offload_param", OffloadConfig),
                       ("aio", AioConfig)):
        sub = {f.rsplit(".", 1)[1]: v for f, (_, v) in merged.items()
               if f.startswith(f"zero.{block}.")}
        if sub and block != "aio" and "pin_memory" not in sub and _backend(parallel) == "nccl":
            # pinned host buffers where the run's tensors are on a GPU: device-to-host copies
            # then run without stalling the host (DeepSpeed's JSON default is false). A gloo
            # run keeps its tensors on the host, and pinning would start CUDA for nothing.
            sub["pin_memory"] = True
        if sub:
            zero_kw[block] = cls(**sub)
    top = {name: merged[name][1] for name in ("deepspeed", "deepspeed_config") if name in merged}
    sections = {name: cls(**_section(name, merged)) for name, cls in _SECTIONS.items()
                if name not in ("model", "parallel", "train")}
    cfg = MegazeroConfig(model=model, parallel=parallel, train=train, zero=ZeroConfig(**zero_kw),
                         **sections, **top)
    for note in script_notes(cfg):
        warnings.warn(note, UserWarning, stacklevel=2)
    cfg = schedule_lengths(cfg, {f for f, (src, _) in merged.items()})
    filled = fill_auto(copy.deepcopy(ds_checked), cfg)
    if cfg.optimizer.scheduler_type is None:
        return cfg
    params = dict(filled["scheduler"].get("params", {}))
    return replace(cfg, optimizer=replace(cfg.optimizer, scheduler_params=params))
