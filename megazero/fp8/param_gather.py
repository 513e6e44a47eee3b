"""``--fp8-param-gather``: ZeRO-3 all-gathers the weights of FP8 GEMMs as FP8 bytes.

A unit holding one FP8 linear's weight (no bias beside it: Llama-style models and Megatron's
FP8 recipes) is cast to e4m3 on every rank's shard and gathered as one byte per element, half
of bf16's; the ranks agree on the scale by a max-reduce of the shards' amaxes over the ZeRO
group and the weight's tensor-parallel group, so only the bytes travel.

The scale is a power of two, and so are the GEMM's weight scales under this flag. That makes
the gathered weight lossless for the GEMM: ``q / s`` is exact in bf16 (an e4m3 value has four
significant bits), and quantising it again finds ``s`` (or ``2s``, where the largest value
rounded down to 224 and ``2q`` is exact): the GEMM sees the FP8 values it would have made from
the master-cast weight, so the run's losses are those of a run that gathers bf16.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megazero.distributed.collectives import Group
from megazero.fp8.formats import E4M3
from megazero.fp8.quantize import cast, reduce_amax, scale_from_amax


class FP8ParamCodec:
    """Encodes a ZeRO shard of one weight as e4m3 bytes and decodes the gathered whole."""

    def __init__(self, weight_groups: Sequence[Group]):
        self.weight_groups = tuple(weight_groups)
        self.scale = torch.ones(())

    def encode(self, shard: torch.Tensor, zero_group: Group) -> torch.Tensor:
        amax = shard.detach().abs().amax().float() if shard.numel() else \
            shard.new_zeros((), dtype=torch.float32)
        amax = reduce_amax(amax, [zero_group, *self.weight_groups])
        self.scale = scale_from_amax(amax, E4M3, pow2=True)
        return cast(shard, self.scale, E4M3).view(torch.uint8)

    def decode(self, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (gathered.view(E4M3).float() / self.scale).to(dtype)
