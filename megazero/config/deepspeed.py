"""The DeepSpeed JSON config schema: the table of every known key, and checking a config with it.

:data:`DS_CONFIG_KEYS` is the one table of known keys: for each dotted key path its JSON type,
DeepSpeed's default, the :class:`~megazero.config.MegazeroConfig` field it fills (``None``: read
with another key, or no field) and whether megazero implements it. A known key that is not
implemented is accepted with one warning; an unknown key is an error. Flip ``TODO`` to ``IMPL``
when a feature lands.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

from megazero.config.schema import field_choices
from megazero.errors import ConfigError

IMPL, TODO = True, False
INT, FLOAT, BOOL, STR, BETAS, BLOCK, OPEN = "int", "float", "bool", "str", "betas", "block", "open"
_EXPECTED = {INT: "an integer", FLOAT: "a number", BOOL: "true or false", STR: "a string",
             BETAS: "a list of two numbers like [0.9, 0.999]", BLOCK: "an object {...}",
             OPEN: "an object {...}", "list": "a list [...]"}


class UnimplementedConfigWarning(UserWarning):
    """A DeepSpeed config key megazero knows but does not act on yet (see ``TODO`` below)."""


@dataclass(frozen=True)
class Key:
    """One known key. ``field`` is a dotted MegazeroConfig path, or a tuple for a list value."""

    kind: str
    default: Any = None
    field: str | tuple[str, ...] | None = None
    implemented: bool = IMPL
    choices: tuple[Any, ...] = ()


def _k(kind: str, default: Any = None, field: str | tuple[str, ...] | None = None,
       implemented: bool = IMPL, choices: tuple[Any, ...] | None = None) -> Key:
    """``choices`` None: the values of the field's ``Literal`` type, if it has one."""
    if choices is None:
        choices = (field_choices(field) if isinstance(field, str) else None) or ()
    return Key(kind, default, field, implemented, choices)


_Z, _OO, _OP = "zero_optimization", "zero_optimization.offload_optimizer", \
    "zero_optimization.offload_param"
_SP = "scheduler.params"

# fmt: off
DS_CONFIG_KEYS: dict[str, Key] = {
    # batch triad: train_batch_size = micro x gradient_accumulation_steps x dp_size
    "train_batch_size": _k(INT, None, "train.global_batch_size"),
    "train_micro_batch_size_per_gpu": _k(INT, None, "train.micro_batch_size"),
    "gradient_accumulation_steps": _k(INT, None, "train.gradient_accumulation_steps"),
    "steps_per_print": _k(INT, 10, "logging.steps_per_print"),
    "wall_clock_breakdown": _k(BOOL, False, "logging.wall_clock_breakdown"),
    "gradient_clipping": _k(FLOAT, 0.0, "optimizer.clip_grad"),
    "communication_data_type": _k(STR, None, "precision.communication_data_type"),
    "data_types": _k(BLOCK),
    "data_types.grad_accum_dtype": _k(STR, None, "precision.grad_accum_dtype"),
    "memory_breakdown": _k(BOOL, False, None, TODO),
    "dump_state": _k(BOOL, False, None, TODO),
    "prescale_gradients": _k(BOOL, False, None, TODO),
    "gradient_predivide_factor": _k(FLOAT, 1.0, None, TODO),
    "seq_parallel_communication_data_type": _k(STR, "fp32", None, TODO),
    "zero_allow_untested_optimizer": _k(BOOL, False, None, TODO),
    "zero_force_ds_cpu_optimizer": _k(BOOL, True, None, TODO),
    "sparse_gradients": _k(BOOL, False, None, TODO),
    "disable_allgather": _k(BOOL, False, None, TODO),
    "fp32_allreduce": _k(BOOL, False, None, TODO),
    "load_universal_checkpoint": _k(BOOL, False, None, TODO),
    "graph_harvesting": _k(BOOL, False, None, TODO),
    # optimizer: type Adam/AdamW/SGD/Lion (see OPTIMIZER_TYPES); params of DeepSpeed's Adam variants
    "optimizer": _k(BLOCK),
    "optimizer.type": _k(STR, "AdamW", "optimizer.optimizer", choices=()),  # any case: merge.py
    "optimizer.params": _k(BLOCK),
    "optimizer.legacy_fusion": _k(BOOL, False, None, TODO),
    "optimizer.params.lr": _k(FLOAT, 1e-3, "optimizer.lr"),
    "optimizer.params.betas": _k(BETAS, [0.9, 0.999],
                                 ("optimizer.adam_beta1", "optimizer.adam_beta2")),
    "optimizer.params.eps": _k(FLOAT, 1e-8, "optimizer.adam_eps"),
    "optimizer.params.weight_decay": _k(FLOAT, 0.0, "optimizer.weight_decay"),
    "optimizer.params.adam_w_mode": _k(BOOL, True),  # read with optimizer.type
    "optimizer.params.torch_adam": _k(BOOL, False),  # torch.optim is always used: same math
    "optimizer.params.momentum": _k(FLOAT, 0.0, "optimizer.sgd_momentum"),  # SGD
    "optimizer.params.nesterov": _k(BOOL, False, "optimizer.sgd_nesterov"),
    "optimizer.params.dampening": _k(FLOAT, 0.0, "optimizer.sgd_dampening"),
    "optimizer.params.fused": _k(BOOL, False, None, TODO),
    "optimizer.params.bias_correction": _k(BOOL, True, "optimizer.bias_correction"),
    "optimizer.params.amsgrad": _k(BOOL, False, None, TODO),
    "optimizer.params.freeze_step": _k(INT, 100000, "optimizer.freeze_step"),  # OneBitAdam
    "optimizer.params.cuda_aware": _k(BOOL, False, "optimizer.cuda_aware"),
    "optimizer.params.comm_backend_name": _k(STR, "nccl", "optimizer.comm_backend_name"),
    "optimizer.params.var_freeze_step": _k(INT, 100000, "optimizer.var_freeze_step"),  # 0/1 Adam
    "optimizer.params.var_update_scaler": _k(INT, 16, "optimizer.var_update_scaler"),
    "optimizer.params.local_step_scaler": _k(INT, 32678, "optimizer.local_step_scaler"),
    "optimizer.params.local_step_clipper": _k(INT, 16, "optimizer.local_step_clipper"),
    "optimizer.params.coeff_beta": _k(FLOAT, 0.9, "optimizer.coeff_beta"),  # OneBitLamb
    "optimizer.params.factor_max": _k(FLOAT, 4.0, "optimizer.factor_max"),
    "optimizer.params.factor_min": _k(FLOAT, 0.5, "optimizer.factor_min"),
    "optimizer.params.factor_threshold": _k(FLOAT, 0.1, "optimizer.factor_threshold"),
    "optimizer.params.max_coeff": _k(FLOAT, 10.0, "optimizer.lamb_max_coeff"),  # Lamb
    "optimizer.params.min_coeff": _k(FLOAT, 0.01, "optimizer.lamb_min_coeff"),
    # scheduler: which params each type takes is in SCHEDULER_TYPES
    "scheduler": _k(BLOCK),
    "scheduler.type": _k(STR, None, "optimizer.scheduler_type"),
    _SP: _k(BLOCK),
    f"{_SP}.warmup_min_lr": _k(FLOAT, 0.0),
    f"{_SP}.warmup_max_lr": _k(FLOAT, 1e-3, "optimizer.lr"),
    f"{_SP}.warmup_num_steps": _k(INT, 1000, "optimizer.lr_warmup_iters"),
    f"{_SP}.warmup_type": _k(STR, "log", None, choices=("log", "linear")),
    f"{_SP}.total_num_steps": _k(INT, None, "optimizer.lr_decay_iters"),
    f"{_SP}.warmup_min_ratio": _k(FLOAT, 0.0),
    f"{_SP}.cos_min_ratio": _k(FLOAT, 1e-4),
    f"{_SP}.last_batch_iteration": _k(INT, -1, None, TODO),
    **{f"{_SP}.{name}": _k(kind, None, None, TODO) for name, kind in (
        ("cycle_min_lr", FLOAT), ("cycle_max_lr", FLOAT), ("decay_lr_rate", FLOAT),
        ("cycle_first_step_size", INT), ("cycle_second_step_size", INT),
        ("cycle_first_stair_count", INT), ("cycle_second_stair_count", INT),
        ("decay_step_size", INT), ("cycle_momentum", BOOL), ("cycle_min_mom", FLOAT),
        ("cycle_max_mom", FLOAT), ("decay_mom_rate", FLOAT), ("lr_range_test_min_lr", FLOAT),
        ("lr_range_test_step_size", INT), ("lr_range_test_step_rate", FLOAT),
        ("lr_range_test_staircase", BOOL))},
    # mixed precision ("bfloat16" is read as "bf16")
    "fp16": _k(BLOCK),
    "fp16.enabled": _k(BOOL, False, "precision.fp16"),
    "fp16.loss_scale": _k(FLOAT, 0.0, "precision.loss_scale"),
    "fp16.initial_scale_power": _k(INT, 16, "precision.initial_scale_power"),
    "fp16.loss_scale_window": _k(INT, 1000, "precision.loss_scale_window"),
    "fp16.hysteresis": _k(INT, 2, "precision.hysteresis"),
    "fp16.consecutive_hysteresis": _k(BOOL, False, "precision.consecutive_hysteresis"),
    "fp16.min_loss_scale": _k(FLOAT, 1.0, "precision.min_loss_scale"),
    "fp16.auto_cast": _k(BOOL, False, None, TODO),
    "fp16.fp16_master_weights_and_grads": _k(BOOL, False, None, TODO),
    "bf16": _k(BLOCK),
    "bf16.enabled": _k(BOOL, False, "precision.bf16"),
    "bf16.immediate_grad_update": _k(BOOL, False, None, TODO),
    "bf16.check_grad_overflow": _k(BOOL, False, None, TODO),
    "bf16.bf16_master_weights_and_grads": _k(BOOL, False, None, TODO),
    "amp": _k(OPEN, None, None, TODO),
    # ZeRO
    _Z: _k(BLOCK),
    f"{_Z}.stage": _k(INT, 0, "zero.stage"),
    f"{_Z}.reduce_scatter": _k(BOOL, True, "zero.reduce_scatter"),
    f"{_Z}.allgather_partitions": _k(BOOL, True, "zero.allgather_partitions"),
    f"{_Z}.allgather_bucket_size": _k(INT, 500_000_000, "zero.allgather_bucket_size"),
    f"{_Z}.reduce_bucket_size": _k(INT, 500_000_000, "zero.reduce_bucket_size"),
    f"{_Z}.overlap_comm": _k(BOOL, False, "zero.overlap_comm"),
    f"{_Z}.contiguous_gradients": _k(BOOL, True, "zero.contiguous_gradients"),
    f"{_Z}.stage3_prefetch_bucket_size": _k(INT, 50_000_000, "zero.stage3_prefetch_bucket_size"),
    f"{_Z}.stage3_param_persistence_threshold": _k(INT, 100_000,
                                                   "zero.stage3_param_persistence_threshold"),
    f"{_Z}.stage3_max_live_parameters": _k(INT, 10**9, "zero.stage3_max_live_parameters"),
    f"{_Z}.stage3_max_reuse_distance": _k(INT, 10**9, "zero.stage3_max_reuse_distance"),
    f"{_Z}.sub_group_size": _k(INT, 10**9, "zero.sub_group_size"),
    f"{_Z}.stage3_gather_16bit_weights_on_model_save": _k(
        BOOL, False, "zero.stage3_gather_16bit_weights_on_model_save", TODO),
    f"{_Z}.stage3_gather_fp16_weights_on_model_save": _k(
        BOOL, False, "zero.stage3_gather_16bit_weights_on_model_save", TODO),
    f"{_Z}.round_robin_gradients": _k(BOOL, False, "zero.round_robin_gradients", TODO),
    f"{_Z}.elastic_checkpoint": _k(BOOL, False, "zero.elastic_checkpoint", TODO),
    f"{_Z}.ignore_unused_parameters": _k(BOOL, True, "zero.ignore_unused_parameters"),
    f"{_Z}.zero_hpz_partition_size": _k(INT, 1, "zero.zero_hpz_partition_size", TODO),
    f"{_Z}.zero_quantized_weights": _k(BOOL, False, "zero.zero_quantized_weights", TODO),
    f"{_Z}.zero_quantized_gradients": _k(BOOL, False, "zero.zero_quantized_gradients", TODO),
    **{f"{_Z}.{name}": _k(kind, None, None, TODO) for name, kind in (
        ("load_from_fp32_weights", BOOL), ("cpu_offload", BOOL), ("cpu_offload_param", BOOL),
        ("cpu_offload_use_pin_memory", BOOL), ("stage3_model_persistence_threshold", INT),
        ("stage3_module_granularity_threshold", INT),
        ("stage3_use_all_reduce_for_fetch_params", BOOL), ("stage3_allgather_sequential", BOOL),
        ("legacy_stage1", BOOL), ("zero_quantized_nontrainable_weights", BOOL),
        ("zeropp_loco_param", OPEN), ("mics_shard_size", INT),
        ("mics_hierarchical_params_gather", BOOL), ("memory_efficient_linear", BOOL),
        ("pipeline_loading_checkpoint", BOOL), ("override_module_apply", BOOL),
        ("log_trace_cache_warnings", BOOL), ("use_multi_rank_bucket_allreduce", BOOL),
        ("enable_sanity_checks", BOOL))},
    _OO: _k(BLOCK),
    f"{_OO}.device": _k(STR, "none", "zero.offload_optimizer.device"),
    f"{_OO}.pin_memory": _k(BOOL, False, "zero.offload_optimizer.pin_memory"),
    _OP: _k(BLOCK),
    f"{_OP}.device": _k(STR, "none", "zero.offload_param.device"),
    f"{_OP}.pin_memory": _k(BOOL, False, "zero.offload_param.pin_memory"),
    # NVMe offload (ZeRO-Infinity); checked together in megazero.zero.offload.check_offload
    **{f"{blk}.{name}": _k(kind, None, f"zero.{blk.rsplit('.', 1)[1]}.{name}")
       for blk, name, kind in (
        (_OO, "nvme_path", STR), (_OO, "buffer_count", INT),
        (_OP, "nvme_path", STR), (_OP, "buffer_count", INT), (_OP, "buffer_size", INT),
        (_OP, "max_in_cpu", INT))},
    # read ahead / write behind happen whenever buffer_count leaves room for them
    **{f"{_OO}.{name}": _k(BOOL, False, f"zero.offload_optimizer.{name}", TODO)
       for name in ("pipeline_read", "pipeline_write")},
    **{f"{_OO}.{name}": _k(kind, None, None, TODO) for name, kind in (
        ("fast_init", BOOL), ("ratio", FLOAT), ("super_offload", BOOL),
        ("cpuadam_cores_perc", FLOAT))},
    "aio": _k(BLOCK),
    **{f"aio.{name}": _k(kind, None, f"zero.aio.{field}") for name, kind, field in (
        ("block_size", INT, "block_size"), ("queue_depth", INT, "queue_depth"),
        ("intra_op_parallelism", INT, "intra_op_parallelism"),
        ("thread_count", INT, "intra_op_parallelism"),  # older name of intra_op_parallelism
        ("single_submit", BOOL, "single_submit"), ("overlap_events", BOOL, "overlap_events"),
        ("use_gds", BOOL, "use_gds"))},
    # monitoring
    "tensorboard": _k(BLOCK),
    "tensorboard.enabled": _k(BOOL, False),
    "tensorboard.output_path": _k(STR, "", "logging.tensorboard_dir"),
    "tensorboard.job_name": _k(STR, "DeepSpeedJobName", "logging.tensorboard_job_name"),
    "wandb": _k(BLOCK),
    "csv_monitor": _k(BLOCK),
    **{f"wandb.{name}": _k(kind) for name, kind in (
        ("enabled", BOOL), ("group", STR), ("team", STR), ("project", STR))},
    **{f"csv_monitor.{name}": _k(kind) for name, kind in (
        ("enabled", BOOL), ("output_path", STR), ("job_name", STR))},
    "comet": _k(OPEN, None, None, TODO),
    "comms_logger": _k(BLOCK),
    **{f"comms_logger.{name}": _k(kind) for name, kind in (
        ("enabled", BOOL), ("verbose", BOOL), ("prof_all", BOOL), ("debug", BOOL),
        ("prof_ops", "list"))},
    # asynchronous saves: megazero's key, or DeepSpeed's decoupled checkpoint writer
    "checkpoint": _k(BLOCK),
    "checkpoint.async_save": _k(BOOL, False, "checkpoint.async_save"),
    "checkpoint.writer": _k(BLOCK),
    "checkpoint.writer.decoupled": _k(BOOL, False, "checkpoint.async_save"),
    **{f"checkpoint.writer.{name}": _k(kind, None, None, TODO) for name, kind in (
        ("type", STR), ("io_buffer_size", INT), ("io_buffer_double", BOOL),
        ("show_statistics", BOOL), ("data_parallel", STR), ("io_multiplier", INT))},
    # features megazero does not have (yet); checked one level deep where the keys are stable
    **{f"checkpoint.{name}": _k(kind, None, None, TODO) for name, kind in (
        ("tag_validation", STR), ("load_universal", BOOL), ("use_node_local_storage", BOOL),
        ("parallel_write", OPEN))},
    "flops_profiler": _k(BLOCK),
    **{f"flops_profiler.{name}": _k(kind) for name, kind in (
        ("enabled", BOOL), ("profile_step", INT), ("module_depth", INT), ("top_modules", INT),
        ("detailed", BOOL), ("output_file", STR))},
    # the recomputed forward is counted, not estimated (megazero/observability/flops_profiler.py)
    "flops_profiler.recompute_fwd_factor": _k(FLOAT, 0.0, None, TODO),
    # what a checkpointed layer group keeps; which layers are checkpointed is --recompute-*
    "activation_checkpointing": _k(BLOCK),
    "activation_checkpointing.partition_activations": _k(
        BOOL, False, "parallel.distribute_saved_activations"),
    "activation_checkpointing.cpu_checkpointing": _k(BOOL, False, "parallel.cpu_checkpointing"),
    **{f"activation_checkpointing.{name}": _k(kind, default, None, TODO)
       for name, kind, default in (
           ("contiguous_memory_optimization", BOOL, False), ("number_checkpoints", INT, None),
           ("synchronize_checkpoint_boundary", BOOL, False), ("profile", BOOL, False))},
    **{name: _k(OPEN, None, None, TODO) for name in (
        "autotuning", "elasticity", "compression_training", "data_efficiency",
        "curriculum_learning", "pipeline", "sparse_attention", "hybrid_engine", "nebula",
        "eigenvalue", "progressive_layer_drop", "quantize_training", "compile",
        "timers", "weight_quantization", "torch_autocast", "tensor_parallel")},
}
# fmt: on

#: optimizer.type (lower-cased) -> implemented. DeepSpeed's "Adam" is decoupled (AdamW) unless
#: ``adam_w_mode`` is false (then L2 decay, torch.optim.Adam); "SGD" is torch.optim.SGD; "Lion"
#: is megazero.zero.lion.Lion; "Lamb" is megazero.optim.lamb.Lamb.
OPTIMIZER_TYPES = {"adam": IMPL, "adamw": IMPL, "sgd": IMPL, "lion": IMPL, "lamb": IMPL,
                   "onebitadam": IMPL, "zerooneadam": IMPL, "onebitlamb": IMPL}
#: params only Lamb takes (DeepSpeed's FusedLamb: the trust ratio's clamp)
LAMB_ONLY_PARAMS = ("max_coeff", "min_coeff")
#: params only the 1-bit optimizers take (elsewhere accepted with a warning, as before)
ONEBIT_ONLY_PARAMS = ("freeze_step", "cuda_aware", "comm_backend_name", "var_freeze_step",
                      "var_update_scaler", "local_step_scaler", "local_step_clipper",
                      "coeff_beta", "factor_max", "factor_min", "factor_threshold")
#: params that only one family takes (the other's optimizer would not accept them); Lion takes
#: betas (default 0.9, 0.99) but no other Adam param
ADAM_ONLY_PARAMS = ("betas", "eps", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad")
SGD_ONLY_PARAMS = ("momentum", "nesterov", "dampening")

#: scheduler.type -> (implemented, the params it takes, the --lr-decay-style it means)
SCHEDULER_TYPES: dict[str, tuple[bool, tuple[str, ...], str | None]] = {
    "WarmupLR": (IMPL, ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                        "last_batch_iteration"), "constant"),
    "WarmupDecayLR": (IMPL, ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                             "warmup_type", "total_num_steps", "last_batch_iteration"), "linear"),
    "WarmupCosineLR": (IMPL, ("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                              "cos_min_ratio", "warmup_type", "last_batch_iteration"), "cosine"),
    "OneCycle": (TODO, tuple(k.split(".")[-1] for k in DS_CONFIG_KEYS
                             if k.startswith(f"{_SP}.") and ("cycle" in k or "decay" in k)
                             or k.endswith("last_batch_iteration")), None),
    "LRRangeTest": (TODO, tuple(k.split(".")[-1] for k in DS_CONFIG_KEYS
                                if k.startswith(f"{_SP}.lr_range_test")), None),
}


def unimplemented_zero_keys() -> tuple[tuple[str, Any], ...]:
    """``(ZeroConfig field, DeepSpeed default)`` of each ``zero_optimization`` key that fills a
    field but has no effect yet (marked ``TODO`` above): the ZeRO engine accepts these."""
    out: dict[str, Any] = {}
    for path, key in DS_CONFIG_KEYS.items():
        if path.startswith(f"{_Z}.") and not key.implemented and isinstance(key.field, str) \
                and key.field.count(".") == 1:
            out.setdefault(key.field.split(".")[1], key.default)
    return tuple(out.items())


def _children(parent: str) -> list[str]:
    prefix = f"{parent}." if parent else ""
    return [p[len(prefix):] for p in DS_CONFIG_KEYS
            if p.startswith(prefix) and "." not in p[len(prefix):]]


def _unknown(path: str, key: str, parent: str) -> ConfigError:
    known = _children(parent)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6) or [
        k for k in sorted(known) if k.startswith(key) or key.startswith(k)][:1]
    where = f"in {parent!r}" if parent else "at the top level"
    fix = (f"did you mean {(parent + '.' if parent else '') + close[0]!r}?" if close
           else f"known keys {where}: {', '.join(sorted(known))}")
    return ConfigError(f"unknown key {path!r} {where} of the DeepSpeed config; {fix}")


def _coerce(path: str, key: Key, value: Any) -> Any:
    """``value`` converted to the key's type (``2e8`` -> 200000000), or ConfigError."""
    ok = True
    if key.kind == INT:
        ok = isinstance(value, int | float) and not isinstance(value, bool) \
            and float(value).is_integer()
        value = int(value) if ok else value
    elif key.kind == FLOAT:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif key.kind == BOOL:
        ok = isinstance(value, bool)
    elif key.kind == STR:
        ok = isinstance(value, str)
    elif key.kind == BETAS:
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value))
        value = [float(v) for v in value] if ok else value
    elif key.kind in (BLOCK, OPEN):
        ok = isinstance(value, dict)
    elif key.kind == "list":
        ok = isinstance(value, list)
    if not ok:
        raise ConfigError(f"{path}: got {json.dumps(value)} ({type(value).__name__}), expected "
                          f"{_EXPECTED[key.kind]}" + (" (e.g. 2e8 or 200000000)"
                                                      if key.kind == INT else ""))
    if key.choices and value not in key.choices:
        raise ConfigError(f"{path}: got {json.dumps(value)}, expected one of "
                          f"{', '.join(json.dumps(c) for c in key.choices)}")
    return value


def _walk(obj: dict[str, Any], parent: str, todo: list[str], inside_todo: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in obj.items():
        path = f"{parent}.{name}" if parent else name
        key = DS_CONFIG_KEYS.get(path)
        if key is None:
            raise _unknown(path, name, parent)
        disabled = isinstance(value, dict) and value.get("enabled") is False
        default = key.default is not None and value == key.default
        if not key.implemented and not inside_todo and not disabled and not default:
            todo.append(path)  # a block switched off, or a default, has no effect to warn about
        if value == "auto" and key.kind not in (BLOCK, OPEN):
            out[name] = "auto"
        elif key.kind == BLOCK:
            out[name] = _walk(_coerce(path, key, value), path, todo,
                              inside_todo or not key.implemented)
        else:
            out[name] = _coerce(path, key, value)
    return out


def check_ds_config(ds: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Validate every key of ``ds`` against :data:`DS_CONFIG_KEYS`.

    Returns a normalised copy (integral floats made ints, legacy spellings rewritten) and the
    paths of keys that are accepted but have no effect yet (outermost path of each only, so a
    block of an unimplemented feature gives one warning, not one per entry).
    """
    if not isinstance(ds, dict):
        raise ConfigError(f"the DeepSpeed config must be a JSON object {{...}}, got "
                          f"{type(ds).__name__}")
    ds = dict(ds)
    if "bfloat16" in ds:  # DeepSpeed's older spelling of "bf16"
        if "bf16" in ds:
            raise ConfigError('both "bf16" and its old spelling "bfloat16" are given; keep "bf16"')
        ds["bf16"] = ds.pop("bfloat16")
    if isinstance(ds.get(_Z), bool):  # legacy "zero_optimization": true means stage 1
        ds[_Z] = {"stage": 1 if ds[_Z] else 0}
    todo: list[str] = []
    return _walk(ds, "", todo, False), todo


def get_path(ds: dict[str, Any], path: str) -> Any:
    """The value at dotted ``path`` of a nested dict, or None when absent."""
    node: Any = ds
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def json_field_values(ds: dict[str, Any]) -> dict[str, list[tuple[str, Any]]]:
    """For each MegazeroConfig field, the (key path, value) pairs of ``ds`` that set it.

    ``"auto"`` values set nothing here: they are filled from the command line or defaults.
    """
    found: dict[str, list[tuple[str, Any]]] = {}
    for path, key in DS_CONFIG_KEYS.items():
        value = get_path(ds, path)
        if key.field is None or value is None or value == "auto":
            continue
        if isinstance(key.field, tuple):
            for f, v in zip(key.field, value):
                found.setdefault(f, []).append((path, v))
        else:
            found.setdefault(key.field, []).append((path, value))
    return found
