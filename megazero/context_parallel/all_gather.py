"""All-gather attention (``--cp-comm-type all_gather``): every rank gathers the whole K/V.

Each local query chunk (global chunk ``j`` of ``2·CP``) attends to keys ``[0, (j+1)·c)`` with the
causal mask on the last chunk: no work is spent on keys the mask hides. The backward gathers
K/V again (so only this rank's share is kept between forward and backward, as in the ring),
computes dK/dV of the whole sequence from the local queries and reduce-scatters them back to
the ranks that own each chunk. Simpler than the ring and with no per-step latency, at the cost
of holding the whole K/V during the layer's attention.
"""

from __future__ import annotations

from typing import Any

import torch

from megazero.context_parallel import blockwise
from megazero.context_parallel.split import chunk_ids, zigzag_order
from megazero.distributed.collectives import Group, group_rank, group_size
from megazero.tensor_parallel.mappings import all_gather_dim0, reduce_scatter_dim0


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
    """``[2, b, groups, S, d]``: every rank's K/V in sequence order."""
    cp = group_size(group)
    shares = all_gather_dim0(torch.stack([k, v]).unsqueeze(0).contiguous(), group)
    zig = torch.cat(shares.unbind(0), dim=3)  # rank 0's tokens, rank 1's, ...
    order = zigzag_order(zig.shape[3], cp).to(zig.device)
    return zig.index_select(3, torch.argsort(order))


def _query_chunks(q_len: int, group: Group) -> list[tuple[slice, int]]:
    """``(local slice, keys it may see)`` for the two local query chunks."""
    c = q_len // 2
    ids = chunk_ids(group_rank(group), group_size(group))
    return [(slice(h * c, (h + 1) * c), (j + 1) * c) for h, j in enumerate(ids)]


class AllGatherAttention(torch.autograd.Function):
    """Same contract as :class:`~megazero.context_parallel.ring.RingAttention`."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                scale: float) -> torch.Tensor:
        kv = _gather_kv(k, v, group)
        kern = blockwise.kernels_for(q)
        outs, lses = [], []
        for rows, keys in _query_chunks(q.shape[2], group):
            o, l_ = kern.forward(q[:, :, rows], kv[0, :, :, :keys],
                                            kv[1, :, :, :keys], True, scale)
            outs.append(o)
            lses.append(l_)
        out = blockwise.as_output(torch.cat(outs, dim=2), q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        kv = _gather_kv(k, v, group)
        kern = blockwise.kernels_for(q)
        delta = blockwise.delta(dout, out)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for rows, keys in _query_chunks(q.shape[2], group):
            dq_, dk_, dv_ = kern.backward(
                dout[:, :, rows], delta[:, :, rows], q[:, :, rows], kv[0, :, :, :keys],
                kv[1, :, :, :keys], lse[:, :, rows], True, scale, out[:, :, rows])
            dq[:, :, rows] = dq_
            dkv[0, :, :, :keys] += dk_
            dkv[1, :, :, :keys] += dv_
        cp, seq = group_size(group), dkv.shape[3]
        zig = dkv.index_select(3, zigzag_order(seq, cp).to(dkv.device))
        per_rank = zig.view(*zig.shape[:3], cp, seq // cp, zig.shape[4]).movedim(3, 0).contiguous()
        mine = reduce_scatter_dim0(per_rank, group)[0]
        return (dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None)
