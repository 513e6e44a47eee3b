"""Flash-attention kernels for the blockwise context-parallel attention (CUDA, fp16/bf16).

Ring and all-gather attention need, per block, the output *and* its log-sum-exp, and a backward
that takes the final output and log-sum-exp of the rows (not the block's own). flash-attn's
public ``flash_attn_func`` hides the backward, so this calls its forward/backward kernels
(``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``), whose
keyword names have changed between releases (``window_size`` became ``window_size_left`` /
``window_size_right``, ``softcap`` and ``alibi_slopes`` appeared): the arguments are matched to
the installed signature by name. Causal masks are bottom-right aligned, as flash-attn >= 2.1
aligns them, which is what :func:`~megazero.context_parallel.blockwise.block_forward` means.

Layout in and out is the blockwise one, ``[b, heads, s, d]``; flash-attn works on
``[b, s, heads, d]`` and handles grouped-query K/V itself. Used only when flash-attn imports and
the tensors are CUDA fp16/bf16 (:func:`usable`); the pure-PyTorch blocks are what CPU CI tests.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

try:  # optional dependency
    from flash_attn import flash_attn_interface as _fa
except ImportError:  # pragma: no cover - depends on the environment
    _fa = None


def usable(q: torch.Tensor) -> bool:
    return (_fa is not None and hasattr(_fa, "_flash_attn_forward") and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16))


def _call(fn: Any, **named: Any) -> Any:
    """Call a flash-attn kernel with the arguments its signature names (positionally, in its
    order; the ones it lacks are dropped, the window given either way)."""
    # flash-attn >= 2.7 wraps its kernels as torch custom ops; the Python function is kept
    params = list(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    if "window_size" in params:
        named["window_size"] = (named.get("window_size_left", -1),
                                named.get("window_size_right", -1))
    missing = [p for p in params if p not in named]
    if missing:
        raise RuntimeError(f"flash-attn's {fn.__name__} takes {missing}, which megazero does "
                           "not know how to fill; use --attention-backend sdpa (the pure-PyTorch "
                           "context-parallel path) or a flash-attn 2.x release")
    return fn(*[named[p] for p in params])


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous()


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`megazero.context_parallel.blockwise.block_forward`."""
    assert _fa is not None
    res = _call(_fa._flash_attn_forward, q=_bshd(q), k=_bshd(k), v=_bshd(v), dropout_p=0.0,
                softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, return_softmax=False)
    out, lse = res[0], res[1]
    return out.transpose(1, 2).float(), lse[:, :, :q.shape[2]].float()


def block_backward(dout: torch.Tensor, delta: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`megazero.context_parallel.blockwise.block_backward`; flash-attn
    computes ``delta`` itself from ``out`` (the rows' final output), which it needs."""
    assert _fa is not None and out is not None
    qs, ks, vs = _bshd(q), _bshd(k), _bshd(v)
    dq, dk, dv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
    _call(_fa._flash_attn_backward, dout=_bshd(dout.to(q.dtype)), q=qs, k=ks, v=vs,
          out=_bshd(out.to(q.dtype)), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
          dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
          window_size_right=-1, softcap=0.0, alibi_slopes=None,
          deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None)
    return (dq.transpose(1, 2).float(), dk.transpose(1, 2).float(),
            dv.transpose(1, 2).float())
