"""Multi-head latent attention (MLA, DeepSeek-V2/V3; megatron-core's ``MLASelfAttention``).

Keys and values are not projected per head from the hidden state: one down-projection maps
each token to a small latent ``c_kv`` (``--kv-lora-rank``) plus one shared positional key
``k_pe`` (``--qk-pos-emb-head-dim``), the latent is normalised (RMSNorm), and per-head
up-projections make each head's positionless key ``k_nope`` (``--qk-head-dim``) and value
(``--v-head-dim``). Queries are made the same way through their own latent when
``--q-lora-rank`` is set, else by one projection. RoPE acts only on the ``pe`` part
("decoupled RoPE"): each head's query ``[q_nope, rope(q_pe)]`` meets the key
``[k_nope, rope(k_pe)]``, with ``k_pe`` shared by all heads. What generation caches is the
latent and the rotated ``k_pe``, ``kv_lora_rank + pe`` numbers a token instead of
``2 * heads * d``.

Tensor parallelism splits the heads: the up-projections are column-parallel, the output
projection row-parallel. The down-projections and the latent norms are small and replicated:
every TP rank computes them on the whole (sequence-gathered) input, and each rank's backward
covers only its own heads, so their gradients are partial. They are flagged
``tp_partial_grad`` and summed over the TP group once, with or without sequence parallelism,
before the data-parallel reduction (:func:`megazero.zero.build.deferred_kinds`); the input's
gradient is summed by the region op the input enters through (all-reduce, or reduce-scatter
under SP), once for all the down-projections.

Core attention is the model's (:class:`~megazero.model.attention.CoreAttention`), so its
backends, selective recompute and context parallelism all apply. It assumes one width for
q, k and v and a ``1/sqrt(width)`` scale: the narrower of (q, k) and v is zero-padded to the
other's width (zeros add nothing to ``q.k`` and give output columns that are cut away), and
the queries are pre-multiplied so that the backend's scale becomes MLA's
``mscale^2 / sqrt(qk_head_dim + pe)`` (YaRN's ``--mscale-all-dim``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig
from megazero.model.attention import CoreAttention
from megazero.model.init import declare_linear, scope
from megazero.model.norms import build_norm
from megazero.model.positional import apply_rotary, yarn_mscale
from megazero.model.qk_norm import mark_tp_partial_grad
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.layers import (
    DEFAULT_GEMM,
    DEFERRED_INIT,
    Gemm,
    LinearSavingWeight,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megazero.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
)
from megazero.tensor_parallel.utils import divide


class ReplicatedLinear(nn.Module):
    """``x W^T (+ b)`` with the whole weight on every TP rank, its gradient partial per rank
    (summed over TP by the gradient sync: ``tp_partial_grad``)."""

    def __init__(self, in_size: int, out_size: int, *, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_size, in_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_size, dtype=dtype)) if bias else None
        self.gemm: Gemm = DEFAULT_GEMM
        declare_linear(self)
        mark_tp_partial_grad(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = LinearSavingWeight.apply(  # type: ignore[no-untyped-call]
            x, self.weight, self.gemm)
        return y if self.bias is None else y + self.bias


class HeadsLinear(nn.Module):
    """A column-parallel weight (this rank's heads' rows) applied to an input every TP rank
    already holds whole: no communication here, the input's gradient stays partial and is
    summed where the input entered the TP region."""

    def __init__(self, in_size: int, out_size: int, tp_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(divide(out_size, tp_size), in_size, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, 0)
        self.gemm: Gemm = DEFAULT_GEMM
        declare_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = LinearSavingWeight.apply(  # type: ignore[no-untyped-call]
            x, self.weight, self.gemm)
        return y


def _latent_norm(config: ModelConfig, size: int, parallel: ParallelContext) -> nn.Module:
    # RMSNorm as DeepSeek's; replicated and partial like the down-projections
    norm = build_norm("RMSNorm", size, config.norm_epsilon, False, parallel.params_dtype,
                      config.apply_layernorm_1p)
    return mark_tp_partial_grad(norm)


class MultiLatentAttention(nn.Module):
    """``forward(x [s(/t), b, h], rotary) -> [s(/t), b, h]``, as
    :class:`~megazero.model.attention.SelfAttention`; ``rotary`` is the table of the
    ``pe`` width (``config.rotary_dim``)."""

    def __init__(self, config: ModelConfig, *, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        mla = config  # the MLA fields (--q-lora-rank ...) live on the model config
        tp, dtype, h = parallel.tp_size, parallel.params_dtype, config.hidden_size
        heads = config.num_attention_heads
        self.local_heads = divide(heads, tp)
        self.nope, self.pe, self.v_dim = mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        q_width = heads * (self.nope + self.pe)
        bias = config.add_bias_linear
        self.linear_q_proj: nn.Module | None = None
        self.linear_q_down_proj: nn.Module | None = None
        self.q_layernorm: nn.Module | None = None
        self.linear_q_up_proj: nn.Module | None = None
        if mla.q_lora_rank is None:
            self.linear_q_proj = scope(HeadsLinear(h, q_width, tp, dtype), "linear_q_proj")
        else:
            self.linear_q_down_proj = scope(
                ReplicatedLinear(h, mla.q_lora_rank, bias=bias, dtype=dtype),
                "linear_q_down_proj")
            self.q_layernorm = scope(_latent_norm(config, mla.q_lora_rank, parallel),
                                     "q_layernorm")
            self.linear_q_up_proj = scope(HeadsLinear(mla.q_lora_rank, q_width, tp, dtype),
                                          "linear_q_up_proj")
        self.linear_kv_down_proj = scope(
            ReplicatedLinear(h, mla.kv_lora_rank + self.pe, bias=bias, dtype=dtype),
            "linear_kv_down_proj")
        self.kv_layernorm = scope(_latent_norm(config, mla.kv_lora_rank, parallel),
                                  "kv_layernorm")
        self.linear_kv_up_proj = scope(
            HeadsLinear(mla.kv_lora_rank, heads * (self.nope + self.v_dim), tp, dtype),
            "linear_kv_up_proj")
        self.core_attention = CoreAttention(config.attention_dropout, parallel=parallel)
        self.linear_proj = RowParallelLinear(
            heads * self.v_dim, h, parallel=parallel, bias=bias, init_method=DEFERRED_INIT)
        scope(declare_linear(self.linear_proj, depth_scaled=True), "linear_proj")
        self.softmax_scale = (yarn_mscale(mla.rotary_scaling_factor, mla.mscale_all_dim) ** 2
                              / math.sqrt(self.nope + self.pe))

    # -- pieces shared with generation's cached forward ---------------------------------------

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence on every TP rank (gathered under SP); backward sums the
        ranks' partial input gradients."""
        p = self.parallel
        if p.tp_size == 1:
            return x
        if p.sequence_parallel:
            return gather_from_sequence_parallel_region(x, p.tp_group)
        return copy_to_tensor_parallel_region(x, p.tp_group)

    def queries(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        """``[s, b, heads/t, nope + pe]`` with RoPE on the ``pe`` part."""
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(x)
        else:
            assert self.linear_q_down_proj is not None and self.q_layernorm is not None
            assert self.linear_q_up_proj is not None
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        s, b = q.shape[:2]
        q = q.view(s, b, self.local_heads, self.nope + self.pe)
        if rotary is None:
            return q
        q_nope, q_pe = q.split([self.nope, self.pe], dim=-1)
        return torch.cat([q_nope, apply_rotary(q_pe, *rotary)], dim=-1)

    def latent(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a token keeps for attention: the normalised latent ``[s, b, kv_lora_rank]``
        and the rotated shared key ``[s, b, 1, pe]`` (generation caches exactly these)."""
        c, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pe], dim=-1)
        k_pe = k_pe.unsqueeze(2)
        if rotary is not None:
            k_pe = apply_rotary(k_pe, *rotary)
        return self.kv_layernorm(c), k_pe

    def keys_values(self, c: torch.Tensor, k_pe: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' keys ``[s, b, heads/t, nope + pe]`` and values."""
        kv = self.linear_kv_up_proj(c)
        s, b = kv.shape[:2]
        k_nope, v = kv.view(s, b, self.local_heads, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(s, b, self.local_heads, self.pe)], dim=-1)
        return k, v

    def padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v at one width with q pre-scaled: the backend's ``1/sqrt(width)`` then
        applies MLA's softmax scale (module docstring)."""
        qk, width = q.shape[-1], max(q.shape[-1], v.shape[-1])
        q = q * (self.softmax_scale * math.sqrt(width))
        if qk < width:
            q, k = F.pad(q, (0, width - qk)), F.pad(k, (0, width - qk))
        elif v.shape[-1] < width:
            v = F.pad(v, (0, width - v.shape[-1]))
        return q, k, v

    def context(self, ctx: torch.Tensor) -> torch.Tensor:
        """The padded backend output ``[s, b, heads/t * width]`` -> ``[s, b, heads/t * v]``."""
        s, b = ctx.shape[:2]
        ctx = ctx.view(s, b, self.local_heads, -1)[..., :self.v_dim]
        return ctx.reshape(s, b, self.local_heads * self.v_dim)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        x = self.enter(x)
        q = self.queries(x, rotary)
        k, v = self.keys_values(*self.latent(x, rotary))
        ctx = self.core_attention(*self.padded(q, k, v))
        return self.linear_proj(self.context(ctx))
