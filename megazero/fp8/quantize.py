"""Quantise and dequantise: scales from amaxes that cover the whole (global) tensor.

A scale ``s`` maps a tensor onto the FP8 grid: ``q = fp8(clamp(x * s, -max, max))``, and
dequantising is ``q / s``. With ``amax`` the largest magnitude the scale covers,
``s = max_fp8 / amax / 2**margin`` (Transformer Engine's formula; ``s = 1`` for an all-zero
tensor). Multiplying by ``s`` and casting are elementwise and exact to reproduce, so a value is
quantised the same way on every layout *if its scale is*: each amax here is taken over the
global tensor, or the global tile, whatever slice of it this rank holds.

* The amax of a whole tensor is a max-reduce over the groups that shard it
  (:func:`reduce_amax`; a group over which the tensor is replicated changes nothing).
* A tile's amax (1 x ``block`` along a row, or ``block`` x ``block`` of a weight) is taken in
  the tile grid of the *global* tensor: :class:`Shard` maps this rank's indices to global ones,
  so a tile split between ranks is max-reduced over the group, and a shard that does not start
  on a tile boundary (a tp 2 slice of a 64-wide row in 128-wide tiles) gets the tp 1 scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.distributed.collectives import Group, group_size
from megazero.fp8.formats import fp8_max


@dataclass(frozen=True)
class Shard:
    """This rank's slice of one dim of a global tensor, as Megatron's partition attributes say:
    ``size`` ranks, this one ``rank``; with ``stride`` k the global dim is k equal parts and
    the slice is this rank's piece of each (SwiGLU's ``[gate; up]``)."""

    rank: int
    size: int
    stride: int = 1
    group: Group = None

    def global_index(self, local_len: int, device: torch.device) -> torch.Tensor:
        piece = local_len // self.stride
        i = torch.arange(local_len, device=device)
        part, offset = i // piece, i % piece
        return part * (piece * self.size) + self.rank * piece + offset


def reduce_amax(amax: torch.Tensor, groups: Sequence[Group]) -> torch.Tensor:
    """Max over every rank of every group (in place on a fresh tensor)."""
    for group in groups:
        if group_size(group) > 1:
            amax = amax.contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                    pow2: bool = False) -> torch.Tensor:
    """``max_fp8 / amax / 2**margin`` in fp32; 1 where the amax is 0 (or not finite). With
    ``pow2`` rounded down to a power of two (then dequantising is exact in any float type)."""
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    # a tensor divided by a tensor: ``float / tensor`` multiplies by the reciprocal, two
    # roundings, and the scale would not be the correctly rounded quotient torchao computes
    top = torch.full_like(amax, fp8_max(dtype))
    scale = torch.where(ok, top / torch.where(ok, amax, 1.0), 1.0)
    scale = scale / (2.0 ** margin)
    if pow2:
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(clamp(x * scale))``: saturating, as Transformer Engine's casts (an e4m3fn cast of
    an out-of-range value would give NaN)."""
    m = fp8_max(dtype)
    return (x.float() * scale).clamp_(-m, m).to(dtype)


@dataclass
class Scaled:
    """An FP8 tensor and its scales. ``scale`` is a 0-dim tensor (one per tensor), or a grid
    of tile scales with ``rows`` / ``cols`` mapping each row / column to its tile (``None``:
    the grid has one entry along that dim per row / one for all columns)."""

    data: torch.Tensor
    scale: torch.Tensor
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    @property
    def tensorwise(self) -> bool:
        return self.scale.dim() == 0

    def element_scale(self) -> torch.Tensor:
        s = self.scale
        if self.tensorwise:
            return s
        if self.rows is not None:
            s = s.index_select(0, self.rows)
        return s if self.cols is None else s.index_select(1, self.cols)

    def dequantize(self) -> torch.Tensor:
        """``q / s`` in fp32 (exact: an FP8 value times a power-free fp32 reciprocal is one
        rounding, the same on every rank)."""
        return self.data.float() / self.element_scale()


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, groups: Sequence[Group] = (),
                        margin: int = 0, scale: torch.Tensor | None = None,
                        pow2: bool = False) -> tuple[Scaled, torch.Tensor]:
    """One scale for the whole tensor: from its global amax now (current scaling; a power of
    two with ``pow2``), or ``scale`` when given (delayed scaling). Returns the scaled tensor
    and the global amax."""
    local = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    amax = reduce_amax(local, groups)
    if scale is None:
        scale = scale_from_amax(amax, dtype, margin, pow2)
    return Scaled(cast(x, scale, dtype), scale), amax


def _tile_amax(a: torch.Tensor, index: torch.Tensor, tiles: int) -> torch.Tensor:
    """Max of ``|a|`` over the columns of each tile: ``[rows, tiles]``."""
    out = a.new_zeros(a.shape[0], tiles)
    return out.scatter_reduce_(1, index.expand(a.shape[0], -1), a, "amax")


def quantize_row_tiles(x: torch.Tensor, dtype: torch.dtype, block: int | None,
                       shard: Shard | None = None) -> Scaled:
    """A scale per 1 x ``block`` tile of each row of the 2-D ``x`` (``block`` None: one per
    row). Tiles are cut from the global row; with ``shard`` (the row's dim split over
    ``shard.group``) a tile's amax is max-reduced over that group."""
    rows, k = x.shape
    a = x.detach().abs().float()
    if shard is None or shard.size == 1:
        index = torch.arange(k, device=x.device)
        k_global = k
    else:
        index = shard.global_index(k, x.device)
        k_global = k * shard.size
    width = k_global if block is None else block
    tiles = -(-k_global // width)
    index = index // width
    amax = reduce_amax(_tile_amax(a, index, tiles),
                       [shard.group] if shard is not None and shard.size > 1 else [])
    scale = scale_from_amax(amax, dtype)
    return Scaled(cast(x, scale.index_select(1, index), dtype), scale, None, index)


def quantize_weight_blocks(w: torch.Tensor, dtype: torch.dtype, block: int, shard_dim: int,
                           shard: Shard | None) -> Scaled:
    """A scale per ``block`` x ``block`` block of the global weight ``[N, K]`` (DeepSeek-V3's
    weight blocks); this rank's ``w`` is its slice along ``shard_dim``, and a block split
    between ranks is max-reduced over ``shard.group``."""
    idx = []
    sizes = []
    for dim in (0, 1):
        n = w.shape[dim]
        if shard is not None and dim == shard_dim and shard.size > 1:
            idx.append(shard.global_index(n, w.device) // block)
            sizes.append(-(-n * shard.size // block))
        else:
            idx.append(torch.arange(n, device=w.device) // block)
            sizes.append(-(-n // block))
    a = w.detach().abs().float()
    # rows first: [N, K] -> [Tr, K] -> [Tr, Tc]
    by_rows = a.new_zeros(sizes[0], a.shape[1]).scatter_reduce_(
        0, idx[0].unsqueeze(1).expand_as(a), a, "amax")
    amax = _tile_amax(by_rows, idx[1], sizes[1])
    if shard is not None and shard.size > 1:
        amax = reduce_amax(amax, [shard.group])
    scale = scale_from_amax(amax, dtype)
    element = scale.index_select(0, idx[0]).index_select(1, idx[1])
    return Scaled(cast(w, element, dtype), scale, idx[0], idx[1])
