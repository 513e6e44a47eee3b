"""Shard arithmetic and reassembly of full tensors from TP shards (tests, checkpoints)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from megazero.tensor_parallel.mappings import (
    Group,
    all_gather_last_dim,
    group_rank,
    group_size,
    split_dim,
)

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def shard_tensor(full: torch.Tensor, dim: int, stride: int, rank: int, world: int
                 ) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim``: with ``stride`` k, the full tensor is k
    blocks and the slice is this rank's part of each block, concatenated."""
    if world == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard_tensor(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every rank's slice in rank order."""
    if len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(len(shards))],
                     dim=dim)


def gather_from_tensor_parallel_output(y: torch.Tensor, group: Group, stride: int = 1
                                       ) -> torch.Tensor:
    """Autograd all-gather of a column-parallel output along the last dim (stride-aware)."""
    from megazero.tensor_parallel.mappings import gather_from_tensor_parallel_region

    if group_size(group) == 1:
        return y
    if stride == 1:
        return gather_from_tensor_parallel_region(y, group)
    parts = [gather_from_tensor_parallel_region(p, group) for p in y.chunk(stride, dim=-1)]
    world = group_size(group)
    ordered = [c for p in parts for c in p.chunk(world, dim=-1)]
    return torch.cat(ordered, dim=-1)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, topo_or_tp_rank: Any) -> bool:
    """True if ``param`` should be counted on this rank (for norms and parameter counts):
    TP-sharded parameters on every rank, replicated ones only on TP rank 0. Takes the
    topology or the TP rank."""
    tp_rank = getattr(topo_or_tp_rank, "tp_rank", topo_or_tp_rank)
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def is_duplicate_copy(param: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` duplicates a copy another rank holds, so that
    counting only the copies for which this is False counts every element of the model once per
    data-parallel replica (the global gradient norm and the parameter count both do).

    Duplicates: the last pipeline stage's copy of a tied word embedding (``shared``; the first
    stage's copy is the parameter), and a tensor every tensor-parallel rank holds whole (norms,
    row-parallel biases; not ``tensor_model_parallel``) on tensor-parallel ranks other than 0.
    """
    if getattr(param, "shared", False):
        return True
    if getattr(param, "expert", False):  # its replicas are its expert-data-parallel group,
        # and a tensor the expert-tensor-parallel ranks hold whole counts on their rank 0
        return bool(getattr(param, "expert_tp_duplicate", False))
    return not param_is_not_tensor_parallel_duplicate(param, tp_rank)


def shard_rank_size(param: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(rank, size)`` in the group that splits ``param``: an MoE expert split by expert
    tensor parallelism names its own (``expert_tp_shard``), every other tensor is split over
    the TP group (``tp_rank``, ``tp_size``)."""
    own = getattr(param, "expert_tp_shard", None)
    return (int(own[0]), int(own[1])) if own is not None else (tp_rank, tp_size)


def gather_full_param(param: torch.Tensor, topo: ParallelTopology,
                      unpad: bool = True) -> torch.Tensor:
    """The full (tp=1) tensor of ``param``, reassembled from the TP group (an expert's from the
    expert-tensor-parallel group); collective over that group for sharded parameters. Vocab
    padding is removed unless ``unpad=False``.
    """
    data = param.detach()
    expert_tp = getattr(param, "expert_tp_shard", None) is not None
    size = topo.etp_size if expert_tp else topo.tp_size
    if getattr(param, "tensor_model_parallel", False) and size > 1:
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        moved = data.movedim(dim, -1).contiguous()
        group = topo.etp_group if expert_tp else topo.tp_group
        shards = all_gather_last_dim(moved, group).chunk(size, dim=-1)
        data = unshard_tensor([s.movedim(-1, dim) for s in shards], dim, stride)
    vocab = getattr(param, "vocab_size", None)
    if unpad and vocab is not None:
        data = data.narrow(0, 0, vocab)
    return data.clone()


def shard_full_param(full: torch.Tensor, param: torch.Tensor,
                     topo: ParallelTopology) -> torch.Tensor:
    """This rank's slice of an unpadded full tensor for ``param`` (inverse of gather)."""
    padded = getattr(param, "padded_vocab_size", None)
    if padded is not None and full.shape[0] < padded:
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    if getattr(param, "tensor_model_parallel", False):
        rank, size = shard_rank_size(param, topo.tp_rank, topo.tp_size)
        full = shard_tensor(full, param.partition_dim, getattr(param, "partition_stride", 1),
                            rank, size)
    return full


def full_model_state_dict(model: nn.Module, topo: ParallelTopology, grads: bool = False
                          ) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` reassembled to its full, unpadded tp=1 tensor.

    Names are the model's own (global layer indices for :class:`GPTModel` chunks). With
    ``grads=True`` the gradients are reassembled instead (zeros where a grad is missing).
    Collective over the TP group: call it on every TP rank.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        src = p
        if grads:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            src = _with_attrs(g, p)
        out[name] = gather_full_param(src, topo)
    return out


def _with_attrs(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "vocab_size",
                 "padded_vocab_size", "expert_tp_shard"):
        if hasattr(like, attr):
            setattr(t, attr, getattr(like, attr))
    return t


def broadcast_check_equal(x: torch.Tensor, group: Group) -> bool:
    """True if ``x`` is bitwise identical on every rank of ``group`` (test helper)."""
    if group_size(group) == 1:
        return True
    ref = x.detach().clone().contiguous()
    dist.broadcast(ref, src=dist.get_global_rank(group, 0), group=group)
    return bool(torch.equal(ref, x.detach()))


__all__ = [
    "divide", "shard_tensor", "unshard_tensor", "gather_full_param", "shard_full_param",
    "full_model_state_dict", "param_is_not_tensor_parallel_duplicate", "split_dim",
    "shard_rank_size",
    "group_rank", "broadcast_check_equal",
]
