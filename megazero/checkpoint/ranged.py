"""A saved TP piece held as flat ranges in several files (format version 3), read range by range.

Since version 3 each rank saves the ranges of a parameter's flattened TP shard it owns
(:mod:`megazero.checkpoint.save_ranges`), so one TP piece is spread over the files of its dp
ranks. :class:`RangedPiece` stands where a version-2 piece (one tensor) stood for
:func:`~megazero.checkpoint.tensors.read_slice`: it has the piece's shape and dtype, and
``narrow(0, start, length)`` gives those rows. Rows inside one saved range are a view of that
file's pages (nothing copied); rows across ranges are gathered into a tensor of their size only.
So a loader still reads only the pages of the rows it asks for.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch


class RangedPiece:
    """One TP piece: ``ranges`` are ``(lo, hi, load)`` in order, tiling ``[0, numel)`` of its
    flattened values; ``load()`` returns the 1-D tensor of ``[lo, hi)`` (an mmap view)."""

    def __init__(self, shape: list[int], dtype: torch.dtype,
                 ranges: list[tuple[int, int, Callable[[], torch.Tensor]]]) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.ranges = ranges
        self._starts = [lo for lo, _, _ in ranges]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def flat(self, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)``: a view when one saved range holds them, else a new tensor."""
        if a >= b:
            return torch.empty(0, dtype=self.dtype)
        k = bisect.bisect_right(self._starts, a) - 1
        lo, hi, load = self.ranges[k]
        if b <= hi:
            return load()[a - lo:b - lo]
        out = torch.empty(b - a, dtype=self.dtype)
        pos = a
        while pos < b:
            lo, hi, load = self.ranges[k]
            end = min(b, hi)
            out[pos - a:end - a].copy_(load()[pos - lo:end - lo])
            pos, k = end, k + 1
        return out

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            raise ValueError("a ranged checkpoint piece is read by rows (dim 0)")
        row = math.prod(self.shape[1:])
        return self.flat(start * row, (start + length) * row).view(length, *self.shape[1:])

    def whole(self) -> torch.Tensor:
        return self.flat(0, self.numel()).view(self.shape)


def as_tensor(piece: torch.Tensor | RangedPiece) -> torch.Tensor:
    """The piece as one tensor (a ranged piece is gathered whole: for the paths that need it)."""
    return piece.whole() if isinstance(piece, RangedPiece) else piece
