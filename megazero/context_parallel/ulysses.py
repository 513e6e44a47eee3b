"""Ulysses attention (``--cp-comm-type a2a``): trade the sequence split for a head split.

An all-to-all turns every rank's ``[S/CP, b, heads, d]`` into ``[S, b, heads/CP, d]``: the whole
sequence for a slice of the heads (and the matching slice of the query groups, so grouped-query
attention stays grouped). Ordinary causal attention (any backend, flash included) runs on it,
and a second all-to-all brings the output back to the sequence split. The backward is the two
all-to-alls reversed. Needs ``heads / TP`` and ``query groups / TP`` divisible by CP (checked by
the config rules before launch).

The all-to-all returns the sequence in the zigzag order of the shares (rank 0's two chunks,
then rank 1's, ...); it is permuted into position order before attention and back after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megazero.context_parallel.split import zigzag_order
from megazero.distributed.collectives import Group, group_size

#: ``core(q [S, b, heads, d], k [S, b, groups, d], v) -> [S, b, heads * d]``, causal.
CoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AllToAll(torch.autograd.Function):
    """Cut ``x`` into CP pieces along ``scatter_dim``, send piece ``p`` to rank ``p``, and
    concatenate what arrives along ``gather_dim`` in rank order. Its gradient is the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        cp = group_size(group)
        if x.shape[scatter_dim] % cp != 0:
            raise ValueError(f"all-to-all: dim {scatter_dim} of size {x.shape[scatter_dim]} is "
                             f"not divisible by the context-parallel size {cp}")
        send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return torch.cat(recv.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        back = AllToAll.apply(grad, ctx.group, gather_dim, scatter_dim)  # type: ignore[no-untyped-call]
        return back, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                      core: CoreFn) -> torch.Tensor:
    """``q [s, b, heads, d]``, ``k, v [s, b, groups, d]`` (this rank's zigzag share) ->
    ``[s, b, heads * d]`` of attention over the whole causal sequence."""
    s, b, n, d = q.shape
    cp = group_size(group)
    order = zigzag_order(s * cp, cp).to(q.device)
    natural = torch.argsort(order)

    def to_heads(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = AllToAll.apply(x, group, 2, 0)  # type: ignore[no-untyped-call]
        return out.index_select(0, natural)

    ctx = core(to_heads(q), to_heads(k), to_heads(v))  # [S, b, heads/cp * d]
    ctx = ctx.view(s * cp, b, n // cp, d).index_select(0, order)
    back: torch.Tensor = AllToAll.apply(ctx, group, 0, 2)  # type: ignore[no-untyped-call]
    return back.reshape(s, b, n * d)
