"""The one entry point the model's attention calls when context parallelism is on."""

from __future__ import annotations

import math

import torch

from megazero.context_parallel.all_gather import AllGatherAttention
from megazero.context_parallel.ring import RingAttention
from megazero.context_parallel.ulysses import CoreFn, ulysses_attention
from megazero.distributed.collectives import Group, group_size

#: ``--cp-comm-type`` values (Megatron-core's names).
COMM_TYPES = ("p2p", "all_gather", "a2a")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: Group, comm_type: str = "p2p",
                               core: CoreFn | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag share of the sequence against the whole of it.

    ``q [s, b, heads, d]``, ``k, v [s, b, groups, d]`` -> ``[s, b, heads * d]`` in ``q``'s
    dtype. ``core`` is the ordinary causal attention ``a2a`` runs on the head-split sequence
    (the model passes its backend); ring and all-gather compute in fp32 blocks themselves.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type {comm_type!r}: expected one of {COMM_TYPES}")
    if group_size(group) == 1:
        raise ValueError("context_parallel_attention needs a context-parallel group of 2 or more")
    if comm_type == "a2a":
        if core is None:
            raise ValueError("cp_comm_type 'a2a' needs the core attention function")
        return ulysses_attention(q, k, v, group, core)
    s, b, n, d = q.shape
    fn = RingAttention if comm_type == "p2p" else AllGatherAttention
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    out: torch.Tensor = fn.apply(  # type: ignore[no-untyped-call]
        qh, kh, vh, group, 1.0 / math.sqrt(d))
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d).to(q.dtype)
