"""Reading a rank's TP shard from pieces saved at another TP size (no processes)."""

from __future__ import annotations

import itertools

import torch

from megazero.checkpoint.tensors import ParamInfo, read_slice
from megazero.tensor_parallel.layers import pad_vocab_size
from megazero.tensor_parallel.utils import shard_tensor


def _case(shape, dim, stride, vocab, saved_tp, tp):
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
    entry = {"shape": list(shape), "dim": dim, "stride": stride, "tp": saved_tp,
             "vocab": vocab}
    info = ParamInfo("x", None, 0, False, dim, stride, vocab)
    for t in range(tp):
        want = shard_tensor(padded(tp), dim, stride, t, tp)
        got = read_slice(entry, lambda r: pieces[r], info, tuple(want.shape), t, tp)
        assert torch.equal(got, want), (shape, dim, stride, vocab, saved_tp, tp, t)


def test_every_tp_pair():
    for saved_tp, tp in itertools.product((1, 2, 4), repeat=2):
        _case((8, 6), 0, 1, None, saved_tp, tp)  # column parallel
        _case((6, 8), 1, 1, None, saved_tp, tp)  # row parallel
        _case((16, 3), 0, 2, None, saved_tp, tp)  # SwiGLU fc1: two halves, each split
        _case((13, 5), 0, 1, 13, saved_tp, tp)  # vocabulary of 13 rows: 15, 18, 24 padded
