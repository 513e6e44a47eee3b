"""Ring attention's arithmetic for every CP rank in one process (no process group).

Runs :func:`megazero.context_parallel.ring.forward_step` / ``backward_step`` (the code the ring
runs on each rank) for each rank of a CP group of ``cp``, handing each step the K/V block the
ring would have delivered and adding each dK/dV share to its owner directly. It checks the
block kernels and the merge where a multi-rank world is not at hand (one GPU: flash-attention
in bf16, ``bench/gpu_context_parallel.py``); the transfers themselves are tested on gloo.
"""

from __future__ import annotations

import math

import torch

from megazero.context_parallel import blockwise
from megazero.context_parallel.ring import backward_step, forward_step, step_kind
from megazero.context_parallel.split import split, unsplit


def full_causal_reference(q, k, v, dout):
    """fp32 autograd through plain causal attention: ``(out, dq, dk, dv)`` in ``[s, b, ...]``."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    s, b, n, d = q.shape
    rep = n // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    out = torch.einsum("bnst,tbnd->sbnd", probs, vv)
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def emulate_ring(q, k, v, dout, cp: int, kern: blockwise.Kernels | None = None):
    """``(out, dq, dk, dv)`` of ring attention over ``cp`` emulated ranks, whole sequence,
    ``[s, b, heads|groups, d]`` in the inputs' dtype. ``kern``: default what the ring picks."""
    def share(t, r):  # [s, b, h, d] -> rank r's [b, h, 2c, d]
        return split(t, 0, r, cp).permute(1, 2, 0, 3)

    kern = kern or blockwise.kernels_for(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qs = [share(q, r) for r in range(cp)]
    kvs = [torch.stack([share(k, r), share(v, r)]).contiguous() for r in range(cp)]
    outs, lses = [], []
    for r in range(cp):
        out = lse = None
        for i in range(cp):
            out, lse = forward_step(kern, step_kind(i, (r - i) % cp, r), qs[r],
                                    kvs[(r - i) % cp], scale, out, lse)
        outs.append(blockwise.as_output(out, q.dtype))
        lses.append(lse)
    dkv = [torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) for kv in kvs]
    dqs = []
    for r in range(cp):
        do = share(dout, r)
        delta = blockwise.delta(do, outs[r])
        dq = torch.zeros(qs[r].shape, dtype=torch.float32, device=q.device)
        for i in range(cp):
            src = (r - i) % cp
            dkv[src] += backward_step(kern, step_kind(i, src, r), do, delta, qs[r], kvs[src],
                                      outs[r], lses[r], scale, dq)
        dqs.append(dq)

    def whole(parts):  # rank shares [b, h, 2c, d] -> [s, b, h, d]
        return unsplit([p.permute(2, 0, 1, 3) for p in parts], 0).to(q.dtype)

    return (whole(outs), whole(dqs), whole([g[0] for g in dkv]), whole([g[1] for g in dkv]))
