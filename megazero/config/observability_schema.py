"""The settings of what a run reports that the JSON config carries as blocks: DeepSpeed's
``comms_logger`` and ``flops_profiler``, validated here with the rest of the configuration (the
loggers themselves, in :mod:`megazero.observability`, take the validated settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megazero.errors import ConfigError

# busbw factor kinds (nccl-tests PERFORMANCE.md)
ALL_REDUCE, RING, ONE = "all_reduce", "ring", "one"

# operation -> (the argument whose tensors are the message, busbw factor kind)
OPERATIONS: dict[str, tuple[str | None, str]] = {
    "all_reduce": ("tensor", ALL_REDUCE),
    "broadcast": ("tensor", ONE),
    "reduce": ("tensor", ONE),
    "all_gather": ("tensor_list", RING),
    "all_gather_into_tensor": ("output_tensor", RING),
    "all_gather_single": ("output_tensor", RING),
    "reduce_scatter": ("input_list", RING),
    "reduce_scatter_tensor": ("input", RING),
    "reduce_scatter_single": ("input", RING),
    "all_to_all": ("input_tensor_list", RING),
    "all_to_all_single": ("input", RING),
    "gather": ("tensor", ONE),
    "scatter": ("tensor", ONE),
    "send": ("tensor", ONE),
    "recv": ("tensor", ONE),
    "batch_isend_irecv": ("p2p_op_list", ONE),
    "barrier": (None, ONE),
    # gloo groups on one host reduce and gather ZeRO's buffers in shared memory
    # (megazero.distributed.shm_collectives), outside torch.distributed;
    # megazero.distributed.group_comm reports them
    "shm_all_reduce": (None, ALL_REDUCE),
    "shm_reduce_scatter": (None, RING),
    "shm_all_gather": (None, RING),
}


@dataclass(frozen=True)
class CommsLoggerSettings:
    """The ``comms_logger`` block, validated (DeepSpeed's defaults)."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = ()
    debug: bool = False

    @classmethod
    def from_block(cls, block: Mapping[str, Any]) -> CommsLoggerSettings:
        ops = tuple(block.get("prof_ops") or ())
        unknown = [op for op in ops if op not in OPERATIONS]
        if unknown:
            raise ConfigError(
                f"comms_logger.prof_ops: {', '.join(map(repr, unknown))} is not an operation the "
                f"logger times; write names from: {', '.join(OPERATIONS)}")
        return cls(enabled=bool(block.get("enabled", False)),
                   verbose=bool(block.get("verbose", False)),
                   prof_all=bool(block.get("prof_all", True)), prof_ops=ops,
                   debug=bool(block.get("debug", False)))


@dataclass(frozen=True)
class FlopsProfilerSettings:
    """The ``flops_profiler`` block, validated (DeepSpeed's defaults)."""

    enabled: bool = False
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None

    @classmethod
    def from_block(cls, block: Mapping[str, Any]) -> FlopsProfilerSettings:
        s = cls(enabled=bool(block.get("enabled", False)),
                profile_step=int(block.get("profile_step", 1)),
                module_depth=int(block.get("module_depth", -1)),
                top_modules=int(block.get("top_modules", 1)),
                detailed=bool(block.get("detailed", True)),
                output_file=block.get("output_file") or None)
        for key, value, ok, want in (
                ("profile_step", s.profile_step, s.profile_step >= 1,
                 "the iteration to profile, 1 or more"),
                ("module_depth", s.module_depth, s.module_depth >= -1,
                 "-1 (every depth) or a depth >= 0"),
                ("top_modules", s.top_modules, s.top_modules >= 1, "1 or more")):
            if not ok:
                raise ConfigError(f"flops_profiler.{key}: got {value}; write {want}")
        return s
