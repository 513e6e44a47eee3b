"""Reading a rank's TP shard from pieces saved at another TP size (no processes)."""

from __future__ import annotations

import itertools

import torch

from megazero.checkpoint.ranged import RangedPiece
from megazero.checkpoint.tensors import ParamInfo, read_flat, read_slice
from megazero.tensor_parallel.layers import pad_vocab_size
from megazero.tensor_parallel.utils import shard_tensor


def _ranged(t):
    """``t`` as format version 3 saves it: flat ranges cut anywhere (mid-row), one per file."""
    flat = t.reshape(-1).clone()
    n = flat.numel()
    cuts = sorted({0, min(5, n), min(7, n), n // 2, max(n - 1, 0), n})
    return RangedPiece(list(t.shape), t.dtype,
                       [(a, b, lambda a=a, b=b: flat[a:b]) for a, b in zip(cuts, cuts[1:])])


def _case(shape, dim, stride, vocab, saved_tp, tp, ranged=False):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=g)  # the global (unpadded) tensor

    def padded(t, fill=0.0):
        if vocab is None:
            return full
        rows = pad_vocab_size(vocab, 3, t)
        return torch.cat([full, full.new_full((rows - vocab, *shape[1:]), fill)])

    # Saved padding rows may have drifted from zero in training; loading re-pads with zeros.
    pieces = [shard_tensor(padded(saved_tp, 7.0), dim, stride, r, saved_tp)
              for r in range(saved_tp)]
    if ranged:
        pieces = [_ranged(p) for p in pieces]
    entry = {"shape": list(shape), "dim": dim, "stride": stride, "tp": saved_tp,
             "vocab": vocab}
    info = ParamInfo("x", None, 0, False, dim, stride, vocab)
    for t in range(tp):
        want = shard_tensor(padded(tp), dim, stride, t, tp)
        local = tuple(want.shape)
        got = read_slice(entry, lambda r: pieces[r], info, local, t, tp)
        assert torch.equal(got, want), (shape, dim, stride, vocab, saved_tp, tp, t)
        n, row = want.numel(), want[0].numel()
        # row windows, and flat ranges (ZeRO ranges) cutting rows anywhere, copied ``into``
        for r0, r1 in ((0, 1), (1, local[0]), (local[0] // 2, local[0] - 1)):
            got = read_slice(entry, lambda r: pieces[r], info, local, t, tp, (r0, r1))
            assert torch.equal(got, want[r0:r1]), (shape, dim, stride, saved_tp, tp, t, r0)
        for lo, hi in ((0, n), (1, n - 1), (row + 1, 3 * row), (row, 2 * row), (2, 3)):
            lo, hi = min(lo, n - 1), min(hi, n)
            got = read_flat(entry, lambda r: pieces[r], info, local, t, tp, lo, hi)
            assert torch.equal(got, want.reshape(-1)[lo:hi]), (shape, dim, saved_tp, tp, lo)
            into = torch.full((hi - lo,), -1.0, dtype=torch.float64)
            read_flat(entry, lambda r: pieces[r], info, local, t, tp, lo, hi, into=into)
            assert torch.equal(into, want.reshape(-1)[lo:hi].double()), (shape, saved_tp, lo)


def test_every_tp_pair():
    for (saved_tp, tp), ranged in itertools.product(
            itertools.product((1, 2, 4), repeat=2), (False, True)):
        # ranged: each saved piece as flat ranges in several files (format version 3)
        _case((8, 6), 0, 1, None, saved_tp, tp, ranged)  # column parallel
        _case((6, 8), 1, 1, None, saved_tp, tp, ranged)  # row parallel
        _case((16, 3), 0, 2, None, saved_tp, tp, ranged)  # SwiGLU fc1: two halves, each split
        _case((13, 5), 0, 1, 13, saved_tp, tp, ranged)  # vocabulary of 13 rows: 15, 18, 24


def test_saved_whole_tensor_loads_split():
    """A weights-only checkpoint stores every tensor whole (dim None, tp 1, unpadded vocab)."""
    for shape, dim, stride, vocab in (((16, 3), 0, 2, None), ((6, 8), 1, 1, None),
                                      ((13, 5), 0, 1, 13)):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        entry = {"shape": list(shape), "dim": None, "stride": 1, "tp": 1, "vocab": vocab}
        info = ParamInfo("x", None, 0, False, dim, stride, vocab)
        padded = full if vocab is None else torch.cat(
            [full, full.new_zeros(pad_vocab_size(vocab, 3, 2) - vocab, *shape[1:])])
        for t in range(2):
            want = shard_tensor(padded, dim, stride, t, 2)
            got = read_slice(entry, lambda r, f=full: f, info, tuple(want.shape), t, 2)
            assert torch.equal(got, want), (shape, t)


def test_reads_only_the_rows_asked_for():
    """Bytes taken from the saved pieces: exactly the rows holding the range; a range one
    saved piece holds is a view of it (no copy), so a same-layout load allocates nothing."""
    pieces = [torch.randn(8, 6), torch.randn(8, 6)]  # column parallel, saved at tp 2
    entry = {"shape": [16, 6], "dim": 0, "stride": 1, "tp": 2, "vocab": None}
    info = ParamInfo("x", None, 0, False, 0, 1, None)
    taken: list[int] = []
    got = read_flat(entry, lambda r: pieces[r], info, (8, 6), 1, 2, 7, 20, taken.append)
    assert sum(taken) == 3 * 6 * 4  # rows 1..3 of piece 1 hold elements 7..19
    assert got.untyped_storage().data_ptr() == pieces[1].untyped_storage().data_ptr()
    taken.clear()
    got = read_flat(entry, lambda r: pieces[r], info, (16, 6), 0, 1, 45, 50, taken.append)
    assert sum(taken) == 2 * 6 * 4 and torch.equal(got, torch.cat(pieces).reshape(-1)[45:50])
