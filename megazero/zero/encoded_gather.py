"""ZeRO 1-2's post-step all-gather of a bucket in another encoding (``--fp8-param-gather``).

The bucket's owned shard is encoded into a buffer of its own, one byte per element (the
bucket holds only parameters of one encoding, so every rank's share has the same size), the
buffers are gathered, and every rank decodes each parameter from them: the owner too, since
every rank must compute with the same values, and the one-process run as well, so that it
computes with what any layout does (:mod:`megazero.fp8.param_gather` says why for FP8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from megazero.distributed.group_comm import GroupComm, Handle


class BucketCodec(Protocol):
    """How a bucket's parameters are gathered in another encoding
    (:class:`megazero.fp8.param_gather.FP8BucketCodec`): ``encode`` turns the part of each
    parameter this rank owns into wire bytes (collective over ``zero_group`` and whatever else
    the encoding needs), ``decode`` one parameter's gathered bytes into the compute dtype."""

    def encode(self, parts: Sequence[torch.Tensor], zero_group: Any) -> list[torch.Tensor]: ...

    def decode(self, index: int, gathered: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor: ...


def gather_encoded(dp: GroupComm, codec: BucketCodec, params: torch.Tensor, wire: torch.Tensor,
                   slots: Sequence[tuple[int, int]], own_lo: int, own_hi: int, shared: bool,
                   chunk: int | None, use_broadcast: bool) -> Handle:
    """Encode elements ``[own_lo, own_hi)`` of the bucket ``params`` (parameters at
    ``slots``, ``(start, numel)`` each) into ``wire``, gather ``wire`` over ``dp`` (in place
    when it lies in the group's shared memory), and, once the returned handle is waited for,
    decode every parameter into ``params``."""
    ranges = [(max(start, own_lo), min(start + numel, own_hi)) for start, numel in slots]
    parts = [params[lo:hi] if lo < hi else params[:0] for lo, hi in ranges]
    wire[own_lo:own_hi].zero_()  # the padding
    for (lo, hi), data in zip(ranges, codec.encode(parts, dp.group), strict=True):
        if lo < hi:
            wire[lo:hi].copy_(data)

    def decode() -> None:
        for i, (start, numel) in enumerate(slots):
            params[start:start + numel].copy_(
                codec.decode(i, wire[start:start + numel], params.dtype))

    if dp.size == 1:
        decode()
        return Handle()
    if shared:
        h = dp.all_gather_in_place(wire, async_op=True)
    else:
        h = dp.all_gather(wire, wire[own_lo:own_hi].clone(), async_op=True, chunk=chunk,
                          use_broadcast=use_broadcast)
    return Handle(h, decode)
