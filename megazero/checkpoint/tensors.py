"""What each saved tensor is globally, and how a rank cuts its slice out of the saved pieces.

A parameter's *global name* is its key in the state dict of the model built at tp=1, pp=1,
vpp=1. :class:`GPTModel` chunks already name decoder layers by global index, so a chunk's own
keys are global names; the one exception is the last stage's copy of a tied word embedding
(``output_layer.weight`` with ``shared_embedding``), which is the same tensor as
``embedding.word_embeddings.weight``: it is not saved twice and is loaded from that name.
Modules that are not GPT chunks keep their keys under ``model<i>.`` (plus ``pp<r>.`` when
pp > 1), which is only layout-independent for the TP axis.

A saved piece is one TP shard of one tensor as the saving ranks held it, vocabulary padding
included (since format version 3 spread as flat ranges over the files of the dp ranks that own
them). The index records the global (unpadded) shape, the split dim, the stride (SwiGLU's fused
fc1 holds its slice of both halves) and the TP size; :func:`assemble` rebuilds the global
tensor from the pieces (``unshard_tensor``), drops the padding rows, and
:func:`slice_for` cuts and re-pads the slice the loading rank holds. Loading reads with
:func:`read_slice` / :func:`read_flat` through ``mmap`` loads: a rank touches only the pages of
the rows it asks for, gets views of the file where one saved piece holds them, and otherwise
allocates only what it asked for (a global temporary only where the split dim changed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megazero.checkpoint.ranged import as_tensor, copy_to
from megazero.tensor_parallel.utils import shard_tensor, unshard_tensor

WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class ParamInfo:
    """One parameter of this rank, with what the checkpoint needs to know about it."""

    name: str  # global name
    param: nn.Parameter
    chunk: int
    duplicate: bool  # a tied copy: loaded, never saved
    dim: int | None  # TP split dim, None when replicated over TP
    stride: int
    vocab: int | None  # unpadded rows, for vocabulary-parallel tensors
    # (rank, size) of the group splitting an MoE expert under expert tensor parallelism;
    # None: split over TP (or not split)
    shard: tuple[int, int] | None = None

    def split(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """This rank's place in the group the tensor is split over."""
        return self.shard or (tp_rank, tp_size)

    def global_shape(self, local_shape: tuple[int, ...], tp: int) -> list[int]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.split(0, tp)[1]
        if self.vocab is not None:
            shape[0] = self.vocab
        return shape


def param_infos(models: list[nn.Module], pp_rank: int, pp_size: int) -> list[ParamInfo]:
    out = []
    for i, m in enumerate(models):
        gpt = hasattr(m, "layer_range")
        for key, p in m.named_parameters():
            dup = gpt and key in ("output_layer.weight", "mtp_embedding.weight") and getattr(
                p, "shared_embedding", False)
            if gpt:
                name = WORD_EMBEDDING if dup else key
            else:
                name = (f"pp{pp_rank}." if pp_size > 1 else "") + f"model{i}.{key}"
            tp_split = getattr(p, "tensor_model_parallel", False)
            own = getattr(p, "expert_tp_shard", None)
            out.append(ParamInfo(name, p, i, dup, p.partition_dim if tp_split else None,
                                 getattr(p, "partition_stride", 1) if tp_split else 1,
                                 getattr(p, "vocab_size", None),
                                 (int(own[0]), int(own[1])) if own is not None else None))
    return out


def assemble(entry: dict[str, Any], pieces: list[torch.Tensor]) -> torch.Tensor:
    """The global (tp=1, unpadded) tensor from its saved TP pieces in TP-rank order."""
    full = (pieces[0] if entry["dim"] is None
            else unshard_tensor(list(pieces), entry["dim"], entry["stride"]))
    if entry.get("vocab") is not None:
        full = full.narrow(0, 0, entry["shape"][0])
    return full


def slice_for(full: torch.Tensor, info: ParamInfo, local_shape: tuple[int, ...], tp_rank: int,
              tp_size: int) -> torch.Tensor:
    """This rank's TP shard of a global tensor, vocabulary rows re-padded with zeros."""
    tp_rank, tp_size = info.split(tp_rank, tp_size)
    if info.vocab is not None:
        rows = local_shape[0] * (tp_size if info.dim == 0 else 1)
        if rows > full.shape[0]:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    if info.dim is not None:
        full = shard_tensor(full, info.dim, info.stride, tp_rank, tp_size)
    return full.contiguous()


def read_slice(entry: dict[str, Any], piece: Any, info: ParamInfo,
               local_shape: tuple[int, ...], tp_rank: int, tp_size: int,
               rows: tuple[int, int] | None = None,
               tally: Callable[[int], None] | None = None,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's TP shard (or rows ``[r0, r1)`` of its dim 0), reading only the saved pieces
    that overlap it.

    ``piece(r)`` returns saved TP piece ``r`` (an mmap-backed tensor, or a
    :class:`~megazero.checkpoint.ranged.RangedPiece` over the files of its ranges: either way
    only the rows taken are read from disk). Along the split dim, with stride k, the global
    tensor is k blocks; saved piece r holds rows ``[r*n', (r+1)*n')`` of each block and this
    rank needs
    ``[t*n, (t+1)*n)``. Vocabulary padding sits after the real rows (at the end of the single
    block), so rows at or beyond the real vocabulary are zeros, whatever either side padded to.
    A tensor saved whole (``dim`` None, tp 1, as :func:`write_model_state` writes) is one piece
    of that layout. A split dim that differs from the saved one falls back to :func:`assemble`
    + :func:`slice_for` (a global temporary).

    When one saved piece covers the request exactly, the result is a view of that piece (of the
    file's pages, not a copy): the caller copies it into its destination and must not write to
    it. Otherwise it is a new tensor of the requested size only. ``into``: a tensor of the
    requested shape (any dtype or device) the values are copied into, and returned: no
    temporary at all. ``tally(n)`` is told the bytes taken from the saved pieces (what the mmap
    pages read from disk hold).
    """
    tp_rank, tp_size = info.split(tp_rank, tp_size)
    r0, r1 = rows if rows is not None else (0, local_shape[0] if local_shape else 0)
    dim, k = info.dim, info.stride
    whole = entry["dim"] is None and entry["tp"] == 1
    if not local_shape or (dim is None and entry["dim"] is not None) or (
            dim is not None and not whole and (entry["dim"] != dim or entry["stride"] != k)) or (
            info.vocab is not None and dim not in (None, 0)):
        pieces = [as_tensor(piece(r)) for r in range(entry["tp"])]
        if tally is not None:
            tally(sum(p.numel() * p.element_size() for p in pieces))
        full = assemble(entry, pieces)
        out = slice_for(full, info, local_shape, tp_rank, tp_size)
        out = out if not local_shape else out.narrow(0, r0, r1 - r0)
        return into.copy_(out) if into is not None else out.clone()
    real = entry["shape"][0] if info.vocab is not None else None
    if dim is None:  # replicated: rows of the single piece, zeros past the real vocabulary
        dim, k, tp_rank, n_mine = 0, 1, 0, local_shape[0]
    else:
        n_mine = local_shape[dim] // k
    saved_tp = 1 if whole else entry["tp"]
    first = piece(0)
    n_saved = first.shape[dim] // k  # rows per block in a saved piece
    mine_lo = tp_rank * n_mine  # the block row (global) of this rank's first row in a block
    shift = r0 if dim == 0 else 0  # dim-0 rows before the window

    def src(r: int) -> torch.Tensor:
        p = piece(r)
        return p if dim == 0 else p.narrow(0, r0, r1 - r0)

    copies = []  # (offset in out along dim, source view)
    for b in range(k):
        if dim == 0:
            j0, j1 = max(r0, b * n_mine), min(r1, (b + 1) * n_mine)  # local rows of block b
            if j0 >= j1:
                continue
            lo, hi = mine_lo + j0 - b * n_mine, mine_lo + j1 - b * n_mine
        else:
            lo, hi = mine_lo, mine_lo + n_mine
        hi_real = min(hi, real) if real is not None else hi
        r = lo // n_saved if n_saved else 0
        pos = lo
        while pos < hi_real and r < saved_tp:
            p_lo, p_hi = r * n_saved, (r + 1) * n_saved
            a, z = max(pos, p_lo), min(hi_real, p_hi)
            if a < z:
                copies.append((b * n_mine + a - mine_lo - shift,
                               src(r).narrow(dim, b * n_saved + a - p_lo, z - a)))
                pos = z
            r += 1
    if tally is not None:
        tally(sum(v.numel() * v.element_size() for _, v in copies))
    shape = list(local_shape)
    shape[0] = r1 - r0
    if into is None and len(copies) == 1 and list(copies[0][1].shape) == shape:
        return as_tensor(copies[0][1])  # exactly one saved piece's rows: a view, no copy
    if into is None:
        out = torch.zeros(shape, dtype=first.dtype)
    else:
        out = into
        if real is not None:  # rows past the real vocabulary stay zero
            out.zero_()
    for o, view in copies:
        copy_to(out.narrow(dim, o, view.shape[dim]), view)
    return out


def read_flat(entry: dict[str, Any], piece: Any, info: ParamInfo,
              local_shape: tuple[int, ...], tp_rank: int, tp_size: int, lo: int, hi: int,
              tally: Callable[[int], None] | None = None,
              into: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``[lo, hi)`` of this rank's flattened TP shard (1-D), reading only the dim-0
    rows that hold them (a ZeRO range of a parameter: no full-shard temporary).

    ``into``: a contiguous 1-D tensor of ``hi - lo`` elements to copy them into (returned):
    whole rows go straight into it, only the partial rows at either end pass through a
    one-row temporary."""
    row = math.prod(local_shape[1:])
    if not local_shape or row == 0:
        out = read_slice(entry, piece, info, local_shape, tp_rank, tp_size,
                         tally=tally).reshape(-1)[lo:hi]
        return into.copy_(out) if into is not None else out

    def rows(r0: int, r1: int, dest: torch.Tensor | None = None) -> torch.Tensor:
        return read_slice(entry, piece, info, local_shape, tp_rank, tp_size, (r0, r1), tally,
                          dest)

    if into is None:
        r0, r1 = lo // row, -(-hi // row)
        return rows(r0, r1).reshape(-1)[lo - r0 * row:hi - r0 * row]
    a = min(hi, -(-lo // row) * row)  # the end of a partial first row
    if a > lo:
        into[:a - lo].copy_(rows(lo // row, lo // row + 1).reshape(-1)[lo % row:lo % row + a - lo])
    else:
        a = lo
    b = max(a, hi // row * row)  # the start of a partial last row
    if b > a:
        rows(a // row, b // row, into[a - lo:b - lo].view(b // row - a // row, *local_shape[1:]))
    if hi > b:
        into[b - lo:].copy_(rows(b // row, b // row + 1).reshape(-1)[:hi - b])
    return into
