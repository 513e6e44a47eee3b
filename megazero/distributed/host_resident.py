"""Tensors that megazero keeps in host memory on purpose, named so that a check can find them.

Under NCCL a collective takes only tensors on the rank's GPU; gloo takes host tensors too. On a
CPU machine every tensor is a host tensor, so the device alone cannot tell a CPU test that a
collective would be refused on a cluster. What can: the tensors that stay on the host whatever
the device is — offloaded fp32 masters and optimizer moments, pinned staging buffers, NVMe swap
buffers, checkpoint I/O buffers. Every such buffer is allocated through :func:`host_empty` (or
passed to :func:`mark`), and :func:`is_host_resident` answers for any view of it.

Marking costs nothing unless :func:`track` turned it on (the NCCL-rules test mode does, see
:mod:`megazero.testing.nccl_rules`): then the registry holds a reference to each marked storage,
so an address cannot be freed and reused by an unmarked tensor while the mode is on.
"""

from __future__ import annotations

import torch

_tracking = False
_storages: dict[int, torch.UntypedStorage] = {}


def track(on: bool = True) -> None:
    """Start (or stop) remembering marked tensors; stopping forgets every mark."""
    global _tracking
    _tracking = on
    if not on:
        _storages.clear()


def tracking() -> bool:
    return _tracking


def mark(tensor: torch.Tensor) -> torch.Tensor:
    """Record ``tensor`` (and every view of its storage) as kept on the host; returns it."""
    if _tracking and tensor.device.type == "cpu":
        storage = tensor.untyped_storage()
        if storage.nbytes():
            _storages[storage.data_ptr()] = storage
    return tensor


def is_host_resident(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a buffer passed to :func:`mark` while tracking was on."""
    if not _storages or tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    return storage.nbytes() > 0 and storage.data_ptr() in _storages


def host_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A marked host buffer; pinned (page-locked, for asynchronous copies) only when CUDA exists."""
    return mark(torch.empty(numel, dtype=dtype, device="cpu",
                            pin_memory=pin and torch.cuda.is_available()))


def to_device(tensor: torch.Tensor, device: torch.device | str,
              non_blocking: bool = False) -> torch.Tensor:
    """``tensor.to(device)``: on a GPU run a device copy of a host buffer. On a CPU run the
    same call returns the host buffer itself; while tracking is on it returns an (unmarked)
    copy instead, so that the tensor a collective then receives is what it would be on a GPU,
    not the host-kept buffer."""
    if _tracking and tensor.device == torch.device(device) and is_host_resident(tensor):
        return tensor.clone()
    return tensor.to(device, non_blocking=non_blocking)
