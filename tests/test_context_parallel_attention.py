"""Context-parallel attention equals full causal attention of the whole sequence.

Every rank builds the same random Q/K/V of the whole sequence, runs its zigzag share through
each ``--cp-comm-type`` and compares its share of the output and of dQ/dK/dV with plain
autograd through full causal attention (fp32). Worlds of 2 and 4 gloo ranks, grouped-query
attention (2 query heads per group), several cases per world.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megazero.context_parallel import blockwise, context_parallel_attention, split
from megazero.testing import run_distributed

TOL = 2e-6


def _full_causal(q, k, v):
    """Reference: ``[s, b, heads, d]`` q, ``[s, b, groups, d]`` k/v -> ``[s, b, heads*d]``."""
    s, b, n, d = q.shape
    rep = n // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, n * d)


def _sdpa_core(q, k, v):
    s, b, n, d = q.shape
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qb, kb, vb, is_causal=True, enable_gqa=k.shape[2] != n)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _cases(rank, world):
    group = dist.new_group(list(range(world)))
    worst = {}
    for comm in ("p2p", "all_gather", "a2a"):
        for seq, heads, groups in ((8 * world, 2 * world, world), (4 * world, world, world)):
            g = torch.Generator().manual_seed(seq + heads)
            b, d = 2, 8
            q = torch.randn(seq, b, heads, d, generator=g, requires_grad=True)
            k = torch.randn(seq, b, groups, d, generator=g, requires_grad=True)
            v = torch.randn(seq, b, groups, d, generator=g, requires_grad=True)
            dout = torch.randn(seq, b, heads * d, generator=g)
            ref = _full_causal(q, k, v)
            ref.backward(dout)
            mine = [split.split(t.detach(), 0, rank, world).requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(*mine, group=group, comm_type=comm,
                                             core=_sdpa_core)
            out.backward(split.split(dout, 0, rank, world))
            pairs = [(out, ref)] + [(m.grad, t.grad) for m, t in zip(mine, (q, k, v))]
            errs = [(a - split.split(r.detach(), 0, rank, world)).abs().max().item()
                    for a, r in pairs]
            worst[(comm, seq, heads, groups)] = max(errs)
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_full_causal(world):
    for worst in run_distributed(_cases, world, timeout=180):
        bad = {case: err for case, err in worst.items() if not err < TOL}
        assert bad == {}, f"max |cp - full| over output and dQ/dK/dV: {bad}"


def test_split_unsplit_roundtrip_and_balance():
    x = torch.arange(24)
    for cp in (1, 2, 3):
        parts = [split.split(x, 0, r, cp) for r in range(cp)]
        assert torch.equal(split.unsplit(parts, 0), x)
        assert torch.equal(torch.cat(parts), x[split.zigzag_order(24, cp)])
        # causal work per rank (sum of positions + 1) is the same on every rank
        assert len({int((p + 1).sum()) for p in parts}) == 1
    assert split.split(x, 0, 1, 3).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


def test_lse_merge_of_two_key_blocks_is_full_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # two groups of two heads
    full, full_lse = blockwise.block_forward(q, k, v, False, 0.3)
    out, lse = blockwise.block_forward(q, k[:, :, :2], v[:, :, :2], False, 0.3)
    o2, l2 = blockwise.block_forward(q, k[:, :, 2:], v[:, :, 2:], False, 0.3)
    blockwise.merge(out, lse, o2, l2)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=0)


def test_ring_emulated_in_one_process_equals_full_causal():
    """The one-process emulation the GPU check uses (bench/gpu_context_parallel.py) runs the
    ring's own step functions; on CPU in fp32 it must equal full attention as the ring does."""
    from megazero.testing.cp_emulate import emulate_ring, full_causal_reference

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(32, 2, n, 8, generator=g) for n in (4, 2, 2))
    dout = torch.randn(32, 2, 4, 8, generator=g)
    ref = full_causal_reference(q, k, v, dout)
    for cp in (2, 4):
        for got, want in zip(emulate_ring(q, k, v, dout, cp), ref):
            assert (got - want).abs().max().item() < TOL, cp


class _FakeFlash:
    """flash-attn's kernel contract (``[b, s, heads, d]``, lse ``[b, heads, s]``, the backward
    filling dq/dk/dv in place from the final output and lse), computed with the fp32 blocks;
    ``old``: the 2.5 signature (``window_size`` as one tuple, no ``softcap``)."""

    def __init__(self, old: bool):
        from megazero.context_parallel import blockwise as bw

        def fwd_new(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, alibi_slopes, return_softmax):
            return fwd_old(q, k, v, dropout_p, softmax_scale, causal,
                           (window_size_left, window_size_right), alibi_slopes, return_softmax)

        def fwd_old(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                    return_softmax):
            assert dropout_p == 0 and window_size == (-1, -1) and not return_softmax
            out, lse = bw.block_forward(*(t.transpose(1, 2) for t in (q, k, v)), causal,
                                        softmax_scale)
            return out.transpose(1, 2), lse, None, None

        def bwd_new(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                    causal, window_size_left, window_size_right, softcap, alibi_slopes,
                    deterministic, rng_state=None):
            return bwd_old(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                           softmax_scale, causal, (window_size_left, window_size_right),
                           alibi_slopes, deterministic, rng_state)

        def bwd_old(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, deterministic, rng_state=None):
            t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
            g = bw.block_backward(t[0], bw.delta(t[0], t[4]), t[1], t[2], t[3], softmax_lse,
                                  causal, softmax_scale)
            for dst, src in zip((dq, dk, dv), g):
                dst.copy_(src.transpose(1, 2))

        self._flash_attn_forward = fwd_old if old else fwd_new
        self._flash_attn_backward = bwd_old if old else bwd_new


@pytest.mark.parametrize("old", [False, True])
def test_flash_kernel_wrappers_follow_flash_attn_contract(monkeypatch, old):
    """The flash path's layouts, lse handling and signature matching, against a stand-in that
    keeps flash-attn's contract (the real kernels need CUDA)."""
    from megazero.context_parallel import blockwise as bw
    from megazero.context_parallel import flash
    from megazero.testing.cp_emulate import emulate_ring, full_causal_reference

    monkeypatch.setattr(flash, "_fa", _FakeFlash(old))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(16, 2, n, 8, generator=g) for n in (4, 2, 2))
    dout = torch.randn(16, 2, 4, 8, generator=g)
    ref = full_causal_reference(q, k, v, dout)
    kern = bw.Kernels(flash.block_forward, flash.block_backward)
    for got, want in zip(emulate_ring(q, k, v, dout, 2, kern), ref):
        assert (got - want).abs().max().item() < TOL
