"""A saved TP piece held as flat ranges in several files (format version 3), read range by range.

Since version 3 each rank saves the ranges of a parameter's flattened TP shard it owns
(:mod:`megazero.checkpoint.save_ranges`), so one TP piece is spread over the files of its dp
ranks. :class:`RangedPiece` stands where a version-2 piece (one tensor) stood for
:func:`~megazero.checkpoint.tensors.read_slice`: it has the piece's shape and dtype, and
``narrow(0, start, length)`` gives those rows. Rows inside one saved range are a view of that
file's pages (nothing copied); rows across ranges are :class:`Rows`, copied range by range
into the destination (gathered into a tensor of their size only where a split dim other than 0
cuts their columns). So a loader still reads only the pages of the rows it asks for.
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

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | Rows:
        """Rows ``[start, start + length)``: a view of the file when one saved range holds
        them, else :class:`Rows`, copied range by range into where they go."""
        if dim != 0:
            raise ValueError("a ranged checkpoint piece is read by rows (dim 0)")
        row = math.prod(self.shape[1:])
        a, b = start * row, (start + length) * row
        k = bisect.bisect_right(self._starts, a) - 1
        if a >= b or b <= self.ranges[k][1]:
            return self.flat(a, b).view(length, *self.shape[1:])
        return Rows(self, start, length)

    def whole(self) -> torch.Tensor:
        return self.flat(0, self.numel()).view(self.shape)


class Rows:
    """Rows of a :class:`RangedPiece` that span saved ranges, not yet read: :meth:`copy_into`
    copies each range's part straight into the destination (no temporary)."""

    def __init__(self, piece: RangedPiece, start: int, length: int) -> None:
        self.piece, self.start = piece, start
        self.shape = torch.Size([length, *piece.shape[1:]])
        self.dtype = piece.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.piece.element_size()

    def copy_into(self, dest: torch.Tensor) -> torch.Tensor:
        if not dest.is_contiguous():
            return dest.copy_(self.tensor())
        out = dest.view(-1)
        row = math.prod(self.shape[1:])
        a, b = self.start * row, self.start * row + self.numel()
        k = bisect.bisect_right(self.piece._starts, a) - 1
        pos = a
        while pos < b:
            lo, hi, load = self.piece.ranges[k]
            end = min(b, hi)
            out[pos - a:end - a].copy_(load()[pos - lo:end - lo])
            pos, k = end, k + 1
        return dest

    def tensor(self) -> torch.Tensor:
        return self.copy_into(torch.empty(self.shape, dtype=self.dtype))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Columns of these rows (a split dim other than 0): read into a tensor of the rows."""
        return self.tensor().narrow(dim, start, length)


def copy_to(dest: torch.Tensor, src: torch.Tensor | Rows) -> torch.Tensor:
    """``dest.copy_(src)``, for a tensor or rows still in the files."""
    return src.copy_into(dest) if isinstance(src, Rows) else dest.copy_(src)


def as_tensor(piece: torch.Tensor | RangedPiece | Rows) -> torch.Tensor:
    """The piece as one tensor (a ranged piece is gathered whole: for the paths that need it)."""
    if isinstance(piece, Rows):
        return piece.tensor()
    return piece.whole() if isinstance(piece, RangedPiece) else piece
