"""Attention of one block of queries against one block of keys, with its log-sum-exp, in fp32.

Every context-parallel scheme that splits the keys (ring, all-gather) computes attention as a
sum over key blocks. Each block yields an output normalised over its own keys and the
log-sum-exp ``L`` of its scores; two partial results are merged exactly by the log-sum-exp rule
(:func:`merge`). The backward of a block needs only the final output and final ``L`` of its rows
(the flash-attention recurrence): ``P = exp(S - L)``, ``D = rowsum(dO * O)``,
``dS = P * (dO V^T - D)``, so no block keeps its probabilities.

Layout is heads-major, ``q [b, heads, sq, d]`` and ``k, v [b, groups, sk, d]``; grouped-query
attention is a broadcast over the ``heads / groups`` query heads of each group (no copy of K/V),
and the key gradients are summed over that broadcast. Everything here runs in fp32 whatever the
input dtype: this is the pure-PyTorch path CI tests; GPUs use flash-attention where installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, heads, ...]`` -> ``[b, groups, heads / groups, ...]``."""
    return x.view(x.shape[0], groups, x.shape[1] // groups, *x.shape[2:])


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """``[b, g, rep, sq, sk]`` scaled scores, ``-inf`` where a causal mask hides the key.

    ``causal`` aligns the mask bottom-right: query ``i`` of ``sq`` sees key ``j`` of ``sk`` iff
    ``j <= i + sk - sq`` (the queries are the last ``sq`` positions of the keys' span)."""
    g = k.shape[1]
    s = torch.matmul(_grouped(q.float(), g), k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(sk - sq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, heads, sq, d], lse [b, heads, sq])``, both fp32."""
    b, n, sq, d = q.shape
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.float().unsqueeze(2))
    return out.reshape(b, n, sq, d), lse.reshape(b, n, sq)


def block_backward(dout: torch.Tensor, delta: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in fp32 of this block's share of the attention, given the rows' final
    ``lse`` and ``delta = rowsum(dout * out)`` (both ``[b, heads, sq]``, over all key blocks).
    ``out`` (the rows' final output) is for kernels that compute ``delta`` themselves."""
    b, n, sq, d = q.shape
    g = k.shape[1]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - _grouped(lse, g).unsqueeze(-1))  # [b, g, rep, sq, sk]
    do = _grouped(dout.float(), g)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # [b, g, sk, d]
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - _grouped(delta, g).unsqueeze(-1))
    dq = torch.matmul(ds, k.float().unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.float(), g)).sum(2) * scale
    return dq.reshape(b, n, sq, d), dk, dv


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> None:
    """Fold a block's ``(out_b, lse_b)`` into the running ``(out, lse)`` in place (fp32):
    ``O <- O - sigmoid(L_b - L) (O - O_b)``, ``L <- L - logsigmoid(L - L_b)``."""
    out.sub_(torch.sigmoid(lse_b - lse).unsqueeze(-1) * (out - out_b))
    lse.sub_(F.logsigmoid(lse - lse_b))


class Kernels(NamedTuple):
    """The block forward and backward one attention call uses throughout."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def kernels_for(q: torch.Tensor) -> Kernels:
    """flash-attention's kernels for CUDA fp16/bf16 where flash-attn is installed, else the
    pure-PyTorch fp32 blocks above."""
    from megazero.context_parallel import flash

    if flash.usable(q):
        return Kernels(flash.block_forward, flash.block_backward)
    return Kernels(block_forward, block_backward)


def as_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 ``[b, heads, s, d]`` result in the input dtype, laid out ``[b, s, heads, d]`` in
    memory: the ``[s, b, heads * d]`` context the output projection reads is then a view of it,
    so the tensor kept for backward and the projection's input are one storage."""
    return out.transpose(1, 2).to(dtype).contiguous().transpose(1, 2)


def delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)`` in fp32, ``[b, heads, sq]``."""
    return (dout.float() * out.float()).sum(-1)
