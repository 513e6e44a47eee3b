"""Autograd-aware communication between tensor-parallel ranks.

Each function is named after the region its output lives in (Megatron's convention): a
"tensor parallel region" holds tensors split along the last dim (heads, ffn, vocab) across the
TP group; a "sequence parallel region" holds activations split along dim 0 (the sequence, in the
``[s, b, h]`` layout). Every forward collective is paired with its adjoint in backward, so the
gradient that flows back is exactly the gradient of the single-process computation:

=====================================  ======================  ==========================
function                               forward                 backward
=====================================  ======================  ==========================
copy_to_tensor_parallel_region         identity                all-reduce
reduce_from_tensor_parallel_region     all-reduce              identity
scatter_to_tensor_parallel_region      keep own last-dim part  all-gather last dim
gather_from_tensor_parallel_region     all-gather last dim     keep own last-dim part
scatter_to_sequence_parallel_region    keep own dim-0 part     all-gather dim 0
gather_from_sequence_parallel_region   all-gather dim 0        reduce-scatter dim 0
reduce_scatter_to_sequence_parallel_   reduce-scatter dim 0    all-gather dim 0
region
=====================================  ======================  ==========================

All take the process group explicitly and are the identity when it is ``None`` or has one rank.
The raw collectives (:func:`all_gather_dim0`, :func:`reduce_scatter_dim0`) go through
:mod:`megazero.distributed.collectives`, which picks the implementation per backend for TP and ZeRO
alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.distributed import collectives
from megazero.distributed.collectives import Group, group_rank, group_size

# --- raw collectives (no autograd) -----------------------------------------------------------

def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (rank order)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather(out, x, group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group, impl: str = "auto") -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's dim-0 slice. ``impl`` as the ZeRO
    engine's ``reduce_scatter_impl`` (``auto``: all-to-all on gloo, native elsewhere)."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world != 0:
        raise ValueError(f"reduce-scatter: dim 0 ({x.shape[0]}) not divisible by {world} ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.reduce_scatter(
        out, x, group, collectives.reduce_scatter_impl(impl, collectives.backend_of(group)))
    return out


def split_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim``."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world != 0:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} not divisible by {world}")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    gathered = all_gather_dim0(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


# --- autograd functions ----------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


def _skip(group: Group) -> bool:
    return group_size(group) == 1


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _skip(group) else _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _skip(group) else _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _skip(group) else _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _skip(group) else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _skip(group) else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather along the sequence dim.

    Backward reduce-scatters when the consumer is a tensor-parallel computation (each rank then
    holds a partial gradient of the full sequence); with ``tensor_parallel_output_grad=False``
    the consumer is replicated and every rank already holds the full gradient, so backward only
    keeps this rank's slice.
    """
    return x if _skip(group) else _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _skip(group) else _ReduceScatterToSP.apply(x, group)
