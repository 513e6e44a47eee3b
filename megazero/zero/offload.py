"""Where offloaded model states live: host memory (``device: cpu``) or files (``device: nvme``).

``offload_optimizer`` (stages 1-3) puts the fp32 master weights and the optimizer moments on the
host; the optimizer step runs there (torch's fused CPU Adam/AdamW, see
:func:`megazero.zero.optimizers.update_kernel`), reading gradients
copied from the device one sub-group at a time and writing the updated weights back. With
``device: nvme`` (ZeRO-Infinity) the masters and moments live in swap files under
``nvme_path`` and stream through a few host buffers, one sub-group at a time
(:mod:`megazero.zero.swap`).
``offload_param`` (stage 3) keeps each rank's parameter shard on the host between uses; a gather
copies it to the device first. With ``device: nvme`` the shards live in a swap file and are read
into a buffer ahead of the module that needs them.

:func:`check_offload` is the one place the offload keys are checked; :func:`swap_dir` checks the
directory itself (exists, writable, enough free space) once the bytes needed are known.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from megazero.config import ConfigError, ZeroConfig
from megazero.distributed.host_resident import host_empty

_Z = "zero_optimization"
#: Adam's per-element state that swaps: the fp32 master, exp_avg and exp_avg_sq.
OPTIMIZER_STATES = 3
#: File regions and host buffers are aligned to this many bytes (O_DIRECT needs the device's
#: logical block size; 4096 covers every common one).
ALIGN_BYTES = 4096


@dataclass(frozen=True)
class OffloadPlan:
    optimizer: bool  # masters + moments on the host
    params: bool  # stage-3 parameter shards on the host
    pin_optimizer: bool
    pin_params: bool
    optimizer_nvme: bool = False  # masters + moments in files, streamed through host buffers
    params_nvme: bool = False  # stage-3 shards in files

    @classmethod
    def from_config(cls, zero: ZeroConfig) -> OffloadPlan:
        check_offload(zero)
        params = zero.stage == 3 and zero.offload_param.enabled
        # Offloaded stage-3 shards keep their masters on the host too (never on the device).
        return cls(optimizer=zero.offload_optimizer.enabled or params, params=params,
                   pin_optimizer=zero.offload_optimizer.pin_memory,
                   pin_params=zero.offload_param.pin_memory,
                   optimizer_nvme=zero.offload_optimizer.nvme,
                   params_nvme=params and zero.offload_param.nvme)


def buffer_count(zero: ZeroConfig, block: str) -> int:
    """``buffer_count`` of ``offload_optimizer`` / ``offload_param`` (DeepSpeed's default: None)."""
    value = getattr(zero, block).buffer_count
    return value if value is not None else {"offload_optimizer": 4, "offload_param": 5}[block]


def check_offload(zero: ZeroConfig) -> None:
    """Every rule on the offload keys and the ``aio`` block that needs no file system."""
    for block in ("offload_optimizer", "offload_param"):
        off = getattr(zero, block)
        key = f"{_Z}.{block}"
        if off.buffer_count is not None and off.buffer_count < 0:
            raise ConfigError(f"{key}.buffer_count: got {off.buffer_count}, expected an integer "
                              f">= 0")
        if not off.nvme:
            continue
        if not off.nvme_path:
            raise ConfigError(f'{key}.device is "nvme" but {key}.nvme_path is not set; set '
                              f'"nvme_path" to a directory on a fast local disk (e.g. '
                              f'"/local_nvme"), or use device "cpu"')
        if not isinstance(off.nvme_path, str):
            raise ConfigError(f"{key}.nvme_path: expected a string, got {off.nvme_path!r}")
    oo, op = zero.offload_optimizer, zero.offload_param
    if oo.nvme and buffer_count(zero, "offload_optimizer") < OPTIMIZER_STATES:
        raise ConfigError(
            f"{_Z}.offload_optimizer.buffer_count: got {oo.buffer_count}; NVMe optimizer offload "
            f"needs at least {OPTIMIZER_STATES} buffers of sub_group_size elements (master, "
            f"exp_avg, exp_avg_sq of one sub-group); use 6 to read the next sub-group during "
            f"the update, 9 to also write the previous one behind it")
    if op.nvme and zero.stage == 3:
        if buffer_count(zero, "offload_param") < 1 or op.buffer_size < 1:
            raise ConfigError(f"{_Z}.offload_param: buffer_count ({op.buffer_count}) and "
                              f"buffer_size ({op.buffer_size}) must be >= 1 with device "
                              f'"nvme"; e.g. "buffer_count": 5, "buffer_size": 1e8')
        if op.max_in_cpu < 0:
            raise ConfigError(f"{_Z}.offload_param.max_in_cpu: got {op.max_in_cpu}, expected "
                              f"an integer >= 0 (parameter elements kept in host memory)")
    aio = zero.aio
    for name in ("block_size", "queue_depth", "intra_op_parallelism"):
        if getattr(aio, name) < 1:
            raise ConfigError(f"aio.{name}: got {getattr(aio, name)}, expected an integer >= 1")
    if aio.use_gds and (oo.nvme or op.nvme):
        warnings.warn("aio.use_gds has no effect: swap files are read into host buffers and "
                      "copied to the device from there", UserWarning, stacklevel=3)


def swap_dir(block: str, nvme_path: str, rank: int, need_bytes: int, kind: str) -> str:
    """``nvme_path/megazero_swap/rank{rank}/{kind}``, created; ConfigError naming
    ``zero_optimization.{block}.nvme_path`` if the path is missing, not a writable directory, or
    its file system has less than ``need_bytes`` free."""
    key = f"{_Z}.{block}.nvme_path"
    if not os.path.exists(nvme_path):
        raise ConfigError(f"{key}: {nvme_path!r} does not exist; create the directory (on a "
                          f"fast local disk) or point nvme_path at an existing one")
    if not os.path.isdir(nvme_path):
        raise ConfigError(f"{key}: {nvme_path!r} is not a directory; give a directory for the "
                          f"swap files")
    path = os.path.join(nvme_path, "megazero_swap", f"rank{rank}", kind)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write_probe")
        with open(probe, "wb") as f:
            f.write(b"\0")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key}: cannot write swap files under {nvme_path!r} ({e.strerror}); "
                          f"give a directory this user can write to") from None
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise ConfigError(f"{key}: {nvme_path!r} has {free / 2**30:.2f} GiB free, this rank's "
                          f"swap files need {need_bytes / 2**30:.2f} GiB ({need_bytes} bytes; "
                          f"every rank on the node needs as much); free space there or point "
                          f"nvme_path at a larger disk")
    return path


def aligned_numel(numel: int, elem_size: int) -> int:
    """``numel`` rounded up so that ``numel * elem_size`` is a multiple of :data:`ALIGN_BYTES`."""
    per = ALIGN_BYTES // elem_size
    return -(-numel // per) * per


def aligned_host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer whose first byte is :data:`ALIGN_BYTES`-aligned (O_DIRECT reads need it)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    raw = host_empty(numel + ALIGN_BYTES // elem, dtype, pin)
    skip = (-raw.data_ptr() % ALIGN_BYTES) // elem
    return raw[skip:skip + numel]
