"""Self-attention: column-parallel fused QKV, core attention on this rank's heads,
row-parallel output projection.

The fused QKV weight is laid out by query group, ``[g0: q_0..q_{h/g-1}, k, v][g1: ...]``
(Megatron's layout), so a contiguous split of its rows gives every TP rank whole groups:
``groups/t`` KV groups with their ``heads/t`` query heads.

Three interchangeable core-attention backends compute ``softmax(QK^T/sqrt(d)) V``, causal:

* ``unfused``: explicit scores, softmax, dropout and ``@V`` (Megatron's ``CoreAttention``). It
  saves the ``[b, a, s, s]`` softmax output, dropout mask and dropout output, i.e. exactly the
  ``5as/h`` term of Megatron's activation-memory formula, so it is the backend memory is
  measured with.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``.
* ``flash``: ``flash_attn_func`` (CUDA, fp16/bf16, when flash-attn is installed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig
from megazero.fusions import rope_qk, use_fusion
from megazero.model.dropout import dropout
from megazero.model.init import declare_linear, scope
from megazero.model.positional import apply_rotary
from megazero.model.qk_norm import build_qk_norms
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.layers import (
    DEFERRED_INIT,
    ColumnParallelLinear,
    RowParallelLinear,
)
from megazero.tensor_parallel.random import MODEL_PARALLEL_STREAM

try:  # optional dependency
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = None

_NO_INIT = DEFERRED_INIT


def flash_usable(x: torch.Tensor) -> bool:
    return (flash_attn_func is not None and x.is_cuda
            and x.dtype in (torch.float16, torch.bfloat16))


class CoreAttention(nn.Module):
    """``[s, b, heads, d]`` q and ``[s, b, groups, d]`` k, v -> context ``[s, b, heads*d]``.

    Attention-probability dropout acts on this rank's heads, so it draws from the tracker's
    model-parallel stream (different masks on different TP ranks). The backend and the tracker
    come from ``parallel``.
    """

    def __init__(self, dropout: float, *, parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = parallel or ParallelContext()
        self.dropout, self.backend = dropout, self.parallel.attention_backend
        # packed documents (megazero.model.packed): ``[b, s]`` document ids of the tokens of
        # the model's current micro-batch, set by GPTModel.forward; kept for the backward's
        # recomputation, which under one pipeline stage (the config's rule) runs before the
        # next micro-batch's forward
        self.documents: torch.Tensor | None = None

    def _resolve(self, q: torch.Tensor) -> str:
        if self.backend == "auto":
            return "flash" if flash_usable(q) else "sdpa"
        if self.backend == "flash" and not flash_usable(q):
            raise RuntimeError("attention_backend='flash' needs flash-attn installed and CUDA "
                               f"fp16/bf16 tensors (got {q.device}, {q.dtype})")
        return self.backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.documents is not None:
            from megazero.model.packed import packed_attention

            return packed_attention(q, k, v, self.documents, self.parallel)
        run = {"unfused": self._unfused, "sdpa": self._sdpa, "flash": self._flash}[
            self._resolve(q)]
        if self.parallel.cp_size > 1:  # the sequence is split: attention crosses the split
            return self._context_parallel(q, k, v, run)
        if p == 0.0:  # no randomness drawn: skip swapping generator states
            return run(q, k, v, p)
        with self.parallel.fork(MODEL_PARALLEL_STREAM):
            return run(q, k, v, p)

    def _context_parallel(self, q, k, v, run):
        """This rank's share of the sequence against all of it (``--cp-comm-type``); the
        config refuses attention dropout with CP, so no randomness is drawn here."""
        from megazero.context_parallel import context_parallel_attention

        return context_parallel_attention(
            q, k, v, group=self.parallel.cp_group, comm_type=self.parallel.cp_comm_type,
            core=lambda q_, k_, v_: run(q_, k_, v_, 0.0))

    @staticmethod
    def _unfused(q, k, v, p):
        s, b, n, d = q.shape
        groups = k.shape[2]
        if groups != n:  # grouped-query attention: every query head reads its group's K/V
            k = k.repeat_interleave(n // groups, dim=2)
            v = v.repeat_interleave(n // groups, dim=2)
        qb = q.reshape(s, b * n, d).transpose(0, 1)  # [b*n, s, d]
        kb = k.reshape(s, b * n, d).permute(1, 2, 0)  # [b*n, d, s]
        # The causal mask is an additive -inf bias fed to baddbmm: addition saves nothing for
        # backward, whereas masked_fill would save a mask per layer.
        bias = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
        scores = torch.baddbmm(bias.expand(b * n, s, s), qb, kb, beta=1.0,
                               alpha=1.0 / math.sqrt(d))
        probs = F.softmax(scores, dim=-1)
        if p > 0:
            probs = dropout(probs, p)
        vb = v.reshape(s, b * n, d).transpose(0, 1)  # [b*n, s, d]
        ctx = torch.bmm(probs, vb)  # [b*n, s, d]
        return ctx.transpose(0, 1).reshape(s, b, n * d)

    @staticmethod
    def _sdpa(q, k, v, p):
        s, b, n, d = q.shape
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=p, is_causal=True,
                                             enable_gqa=k.shape[2] != n)
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)

    @staticmethod
    def _flash(q, k, v, p):
        s, b, n, d = q.shape
        qb, kb, vb = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
        # --deterministic-mode turns on torch's deterministic algorithms; flash-attn's backward
        # has its own deterministic (slower, no atomics) variant.
        extra = {"deterministic": True} if torch.are_deterministic_algorithms_enabled() else {}
        out = flash_attn_func(qb, kb, vb, dropout_p=p, causal=True, **extra)
        return out.transpose(0, 1).reshape(s, b, n * d)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, *, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        tp = parallel.tp_size
        d = config.head_dim
        self.head_dim = d
        self.local_heads = config.num_attention_heads // tp
        self.local_groups = config.query_groups // tp
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * d
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, parallel=parallel, bias=config.qkv_bias,
            init_method=_NO_INIT)
        self.core_attention = CoreAttention(config.attention_dropout, parallel=parallel)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, parallel=parallel,
            bias=config.add_bias_linear, init_method=_NO_INIT)
        scope(declare_linear(self.linear_qkv), "linear_qkv")
        scope(declare_linear(self.linear_proj, depth_scaled=True), "linear_proj")
        self.q_layernorm, self.k_layernorm = build_qk_norms(config, parallel)
        self.rope_fusion, self.fusions_on_cpu = config.apply_rope_fusion, config.fusions_on_cpu

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``--qk-layernorm``: each head's queries and keys normalised, before RoPE (the
        identity without the flag). Generation's cached attention calls it too."""
        if self.q_layernorm is None or self.k_layernorm is None:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [s, b, groups/t * (heads/groups + 2) * d]
        s, b = qkv.shape[:2]
        per_group = self.local_heads // self.local_groups
        d = self.head_dim
        qkv = qkv.view(s, b, self.local_groups, (per_group + 2) * d)
        q, k, v = qkv.split([per_group * d, d, d], dim=-1)
        q = q.reshape(s, b, self.local_heads, d)
        q, k = self.normalize_qk(q, k)
        if rotary is not None:
            cos, sin = rotary
            if use_fusion(self.rope_fusion, q, self.fusions_on_cpu):
                q, k = rope_qk(q, k, cos, sin)  # one compiled kernel (megazero.fusions)
            else:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        ctx = self.core_attention(q, k, v)
        return self.linear_proj(ctx)
