"""``--fp8-param-gather``: ZeRO all-gathers the weights of FP8 GEMMs as FP8 bytes.

**ZeRO-3** (:class:`FP8ParamCodec`, per unit, at every forward and backward):

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


class FP8BucketCodec:
    """ZeRO 1-2: the post-step all-gather of a bucket of FP8 GEMM weights as e4m3 bytes.

    The bucket holds only such weights (they are bucketed apart), so every rank's shard of it
    is one byte per element and the ranks gather equal shares. Each weight's scale is the
    power-of-two current scale of the whole weight (the owners' parts max-reduced over the ZeRO
    group in one all-reduce, then over the groups that split the weight), whatever the FP8
    recipe: a delayed scale depends on amaxes of the weight as the GEMM sees it, so it could
    not be both the gather's scale and layout-free without a second round of reductions.

    Every rank, the weight's owner included and the one-process run alike, then holds
    ``q / s`` as its compute copy, so the GEMMs of every layout quantise the same values under
    every recipe (under tensorwise that is also exactly what the GEMM would have made of the
    16-bit weight; under delayed and blockwise the GEMM re-quantises an e4m3 value). The fp32
    masters are untouched: nothing of this is saved, and a resume redoes it from the masters.
    """

    def __init__(self, weight_groups: Sequence[Sequence[Group]]):
        self.weight_groups = [tuple(g) for g in weight_groups]
        self.scales = torch.ones(len(self.weight_groups))

    def encode(self, parts: Sequence[torch.Tensor], zero_group: Group) -> list[torch.Tensor]:
        """Each weight's part that this rank owns (maybe empty), as e4m3 bytes. Collective over
        ``zero_group`` and the weights' groups."""
        device = parts[0].device if parts else torch.device("cpu")
        amax = torch.stack([p.detach().abs().amax().float() if p.numel()
                            else torch.zeros((), device=device) for p in parts])
        amax = reduce_amax(amax, [zero_group])
        by_groups: dict[tuple[Group, ...], list[int]] = {}
        for i, groups in enumerate(self.weight_groups):
            by_groups.setdefault(groups, []).append(i)
        for groups, idx in by_groups.items():  # the same order on every rank of each group
            if groups:
                amax[idx] = reduce_amax(amax[idx], groups)
        self.scales = scale_from_amax(amax, E4M3, pow2=True)
        return [cast(p, self.scales[i], E4M3).view(torch.uint8) for i, p in enumerate(parts)]

    def decode(self, index: int, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight ``index`` of the bucket from its gathered bytes, in the compute dtype."""
        return (gathered.view(E4M3).float() / self.scales[index]).to(dtype)
