"""Ring attention (``--cp-comm-type p2p``): K/V blocks travel around the CP group.

Rank ``r`` holds the zigzag chunks ``r`` and ``2·CP-1-r`` of queries, keys and values
(:mod:`megazero.context_parallel.split`). At step ``i`` it holds the K/V of rank
``s = (r - i) mod CP`` and computes only what the causal mask keeps:

* ``i = 0``: its own K/V, causal (the two local chunks are in position order);
* ``s < r``: every local query against the first K/V chunk (chunk ``s``), unmasked; the second
  (chunk ``2·CP-1-s``) lies after both query chunks;
* ``s > r``: the second local query chunk against all of ``s``'s K/V, unmasked; nothing of
  ``s`` lies before the first query chunk.

So after the first step each rank does half a block's work per step, the same on every rank.
The next K/V block is sent and received with ``batch_isend_irecv`` while the current one is
computed, and partial outputs are merged with the log-sum-exp rule in fp32.

The backward runs the ring again: K/V travel as in the forward, and the gradient of each K/V
block travels with it, each rank adding its share, so after ``CP`` hops every block's dK/dV
arrives back at its owner. The transfer of the accumulated dK/dV overlaps the next block's work.
Nothing but the rank's own Q/K/V, output and log-sum-exp is kept for the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megazero.context_parallel import blockwise
from megazero.distributed.collectives import Group, group_rank, group_size

_KV_TAG, _DKV_TAG = 11, 12


class _Ring:
    """Send to the next rank of the group, receive from the previous one (global ranks)."""

    def __init__(self, group: Group):
        if group is None:
            raise ValueError("ring attention needs a context-parallel process group")
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """Start passing ``send`` on; returns the buffer it is received into and the requests."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list[Any]) -> None:
    for req in reqs:
        req.wait()


def step_kind(i: int, source: int, rank: int) -> str:
    """Which blocks step ``i`` computes, holding the K/V of rank ``source`` (module docstring)."""
    if i == 0:
        return "diagonal"
    return "before" if source < rank else "after"


def forward_step(kern: blockwise.Kernels, kind: str, q: torch.Tensor, kv: torch.Tensor,
                 scale: float, out: torch.Tensor | None, lse: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring step's blocks, merged into the running ``(out, lse)`` (fp32; made by the
    diagonal step, which comes first). ``kv``: ``[2, b, groups, 2c, d]``."""
    c = q.shape[2] // 2
    if kind == "diagonal":
        return kern.forward(q, kv[0], kv[1], True, scale)
    assert out is not None and lse is not None
    if kind == "before":
        o, l_ = kern.forward(q, kv[0, :, :, :c], kv[1, :, :, :c], False, scale)
        blockwise.merge(out, lse, o, l_)
    else:
        o, l_ = kern.forward(q[:, :, c:], kv[0], kv[1], False, scale)
        blockwise.merge(out[:, :, c:], lse[:, :, c:], o, l_)
    return out, lse


def backward_step(kern: blockwise.Kernels, kind: str, dout: torch.Tensor, delta: torch.Tensor,
                  q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  scale: float, dq: torch.Tensor) -> torch.Tensor:
    """One ring step's backward: adds to ``dq`` (fp32) and returns this rank's share of the
    held block's dK/dV (``[2, b, groups, 2c, d]``, fp32)."""
    c = q.shape[2] // 2
    part = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if kind == "diagonal":
        dq_, dk_, dv_ = kern.backward(dout, delta, q, kv[0], kv[1], lse, True, scale, out)
        dq += dq_
        part[0], part[1] = dk_, dv_
    elif kind == "before":
        dq_, dk_, dv_ = kern.backward(dout, delta, q, kv[0, :, :, :c], kv[1, :, :, :c], lse,
                                      False, scale, out)
        dq += dq_
        part[0, :, :, :c], part[1, :, :, :c] = dk_, dv_
    else:
        dq_, dk_, dv_ = kern.backward(dout[:, :, c:], delta[:, :, c:], q[:, :, c:], kv[0],
                                      kv[1], lse[:, :, c:], False, scale, out[:, :, c:])
        dq[:, :, c:] += dq_
        part[0], part[1] = dk_, dv_
    return part


class RingAttention(torch.autograd.Function):
    """``q [b, heads, 2c, d]``, ``k, v [b, groups, 2c, d]`` (this rank's zigzag share) ->
    ``out [b, heads, 2c, d]`` in q's dtype (see :func:`~megazero.context_parallel.blockwise.
    as_output`), attention over the whole causal sequence; merged and differentiated in fp32."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                scale: float) -> torch.Tensor:
        ring = _Ring(group)
        kern = blockwise.kernels_for(q)
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for i in range(ring.size):
            pending = ring.shift(kv, _KV_TAG) if i + 1 < ring.size else None
            kind = step_kind(i, (ring.rank - i) % ring.size, ring.rank)
            out, lse = forward_step(kern, kind, q, kv, scale, out, lse)
            if pending is not None:
                kv, reqs = pending
                _wait(reqs)
        assert out is not None and lse is not None
        out = blockwise.as_output(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), ctx.scale
        kern = blockwise.kernels_for(q)
        delta = blockwise.delta(dout, out)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        # The accumulated dK/dV of the block now held, on its way from the previous rank
        # (requests: that receive and the send of our last accumulation).
        acc_in: tuple[torch.Tensor, list[Any]] | None = None
        for i in range(ring.size):
            pending = ring.shift(kv, _KV_TAG) if i + 1 < ring.size else None
            kind = step_kind(i, (ring.rank - i) % ring.size, ring.rank)
            part = backward_step(kern, kind, dout, delta, q, kv, out, lse, scale, dq)
            if acc_in is not None:
                acc, reqs = acc_in
                _wait(reqs)
                part += acc
            acc_in = ring.shift(part, _DKV_TAG)
            if pending is not None:
                kv, reqs = pending
                _wait(reqs)
        assert acc_in is not None
        dkv, reqs = acc_in
        _wait(reqs)  # after CP hops the block's dK/dV is back with its owner: this rank
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None)
