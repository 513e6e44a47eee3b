"""Where offloaded model states live: host memory (``device: cpu``), pinned when it can be.

``offload_optimizer`` (stages 1-3) puts the fp32 master weights and the optimizer moments on the
host; the optimizer step runs there (torch's foreach AdamW on CPU tensors), reading gradients
copied from the device one sub-group at a time and writing the updated weights back.
``offload_param`` (stage 3) keeps each rank's parameter shard on the host between uses; a gather
copies it to the device first. NVMe offload is not implemented and is rejected with a message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.config import ConfigError, ZeroConfig


@dataclass(frozen=True)
class OffloadPlan:
    optimizer: bool  # masters + moments on the host
    params: bool  # stage-3 parameter shards on the host
    pin_optimizer: bool
    pin_params: bool

    @classmethod
    def from_config(cls, zero: ZeroConfig) -> OffloadPlan:
        for name in ("offload_optimizer", "offload_param"):
            if getattr(zero, name).device == "nvme":
                raise ConfigError(f"zero_optimization.{name}.device 'nvme' is not supported; "
                                  f"use 'cpu' (host memory) or 'none'")
        params = zero.stage == 3 and zero.offload_param.enabled
        # Offloaded stage-3 shards keep their masters on the host too (never on the device).
        return cls(optimizer=zero.offload_optimizer.enabled or params, params=params,
                   pin_optimizer=zero.offload_optimizer.pin_memory,
                   pin_params=zero.offload_param.pin_memory)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer; pinned (page-locked, for asynchronous copies) only when CUDA exists."""
    return torch.empty(numel, dtype=dtype, device="cpu",
                       pin_memory=pin and torch.cuda.is_available())
