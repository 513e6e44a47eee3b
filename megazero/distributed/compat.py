"""Guards for torch APIs newer than the oldest supported torch (``setup.py``; CI runs the core of
the suite on it).

Each name here resolves once, at import, to the newest implementation the installed torch has,
with a fallback that computes the same thing. Code elsewhere calls these instead of probing
``torch.distributed`` itself, so the version rule lives in one place.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist


# ``all_gather_single`` / ``reduce_scatter_single`` are the recent names of the single-tensor
# collectives; ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` exist since torch 2.0.
# Looked up at each call, so a wrapper installed in torch.distributed
# (megazero.observability.comms_logging) sees these calls too.
def all_gather_into_tensor(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        *args, **kwargs)


def reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        *args, **kwargs)

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


# ``init_process_group(device_id=...)`` binds the group to this rank's GPU (torch >= 2.3): NCCL
# creates its communicator there at once instead of guessing the device at the first collective
# (a guess that lands every rank on GPU 0 when the current device was never set).
_INIT_TAKES_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters


def init_device_kwargs(device: torch.device) -> dict[str, Any]:
    """``init_process_group`` keyword arguments binding the group to ``device``: ``device_id``
    for a CUDA device where torch takes it, nothing otherwise (CPU groups bind to no device)."""
    if device.type == "cuda" and _INIT_TAKES_DEVICE_ID:
        return {"device_id": device}
    return {}


def bound_device_index(group: Any = None) -> int | None:
    """The CUDA device the process group was bound to with ``device_id``, if any."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    bound = getattr(pg, "bound_device_id", None)
    if bound is None or getattr(bound, "type", None) != "cuda":
        return None
    return bound.index if bound.index is not None else 0
