"""The experts of one MoE layer held by this rank: a loop of small MLPs, or one grouped GEMM.

Each expert is its own module stored under its *global* index (``experts.7.linear_fc1.weight``
on whichever expert-parallel rank holds expert 7), and its init rule is keyed by that name, so
every expert-parallel layout initialises, saves and loads the same experts (Megatron seeds
experts from the EP rank, so its model changes with the EP size).

Expert parameters are flagged ``expert = True``: their gradients are summed over the
expert-data-parallel group rather than the data-parallel one.

``--moe-grouped-gemm`` stacks the local experts' weights and runs each of fc1 and fc2 as one
``torch._grouped_mm`` over the tokens sorted by expert (:func:`grouped_linear`), where the torch
build, dtype and shapes support it, and as a loop of ``mm`` otherwise: both give the loop's
numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig
from megazero.distributed.collectives import Group
from megazero.errors import ConfigError
from megazero.model.init import declare_linear, scope
from megazero.moe.expert_tp import add_once
from megazero.tensor_parallel.layers import (
    DEFAULT_GEMM,
    Gemm,
    LinearSavingWeight,
    set_tensor_model_parallel_attributes,
)
from megazero.tensor_parallel.weight_grad import run_or_defer_group


class ExpertMLP(nn.Module):
    """One expert: fc1 (``[2F, H]`` with SwiGLU: gate then up), activation, fc2 ``[H, F]``.

    Under expert tensor parallelism (``etp_size`` > 1) this rank holds fc1's rows
    ``[F/etp]`` of each half (column-parallel, stride 2 with SwiGLU) and fc2's matching columns
    (row-parallel); fc2's bias is held whole and added by etp rank 0 only
    (:mod:`megazero.moe.expert_tp`). The shard attributes name the etp group's rank and size
    (``expert_tp_shard``), so init and checkpoints cut the same global tensors."""

    def __init__(self, config: ModelConfig, ffn: int, dtype: torch.dtype, etp_rank: int = 0,
                 etp_size: int = 1):
        super().__init__()
        if ffn % etp_size:
            raise ConfigError(f"--moe-ffn-hidden-size {ffn} is not divisible by "
                              f"--expert-tensor-parallel-size {etp_size}; use a multiple of it")
        local = ffn // etp_size
        rows = 2 * local if config.swiglu else local
        bias = config.add_bias_linear
        self.linear_fc1 = nn.Linear(config.hidden_size, rows, bias=bias, dtype=dtype)
        self.linear_fc2 = nn.Linear(local, config.hidden_size, bias=bias, dtype=dtype)
        scope(declare_linear(self.linear_fc1), "linear_fc1")
        scope(declare_linear(self.linear_fc2, depth_scaled=True), "linear_fc2")
        for p in self.parameters():
            p.expert = True  # type: ignore[attr-defined]
        if etp_size > 1:
            shard = (etp_rank, etp_size)
            stride = 2 if config.swiglu else 1
            for split in (self.linear_fc1.weight, self.linear_fc1.bias):
                if split is not None:
                    set_tensor_model_parallel_attributes(split, 0, stride)
                    split.expert_tp_shard = shard  # type: ignore[attr-defined]
            set_tensor_model_parallel_attributes(self.linear_fc2.weight, 1)
            self.linear_fc2.weight.expert_tp_shard = shard  # type: ignore[attr-defined]
            if self.linear_fc2.bias is not None:  # whole on every etp rank: counted on rank 0
                self.linear_fc2.bias.expert_tp_duplicate = etp_rank != 0  # type: ignore


def activation(h: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The dense MLP's activation (SwiGLU on ``[gate; up]``, or GELU)."""
    if config.swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if config.openai_gelu else "none")


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned strides; the CPU kernel takes fp32 (bf16
    fails on strides, torch 2.13), the CUDA one bf16 (Hopper and newer)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    want = torch.bfloat16 if x.device.type == "cuda" else torch.float32
    if x.dtype != want or w.dtype != want or x.device.type not in ("cpu", "cuda"):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    item = x.element_size()
    return all((n * item) % 16 == 0 for n in (x.shape[-1], w.shape[-2]))


def _segments(counts: list[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


class _GroupedLinear(torch.autograd.Function):
    """``y[seg g] = x[seg g] @ w[g]^T`` for ``w`` ``[G, N, K]``; backward with grouped GEMMs
    too (torch's own backward of ``_grouped_mm`` fails on CPU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], *leaves: torch.Tensor
                ) -> torch.Tensor:
        # The experts' own weights come in, not their stack, so that a zero-bubble B can
        # leave their gradients to W (megazero.tensor_parallel.weight_grad).
        w = torch.stack(leaves)
        ctx.save_for_backward(x, *leaves)
        ctx.counts = counts
        if _grouped_mm_usable(x, w):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            try:
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            except RuntimeError:  # a layout this build's kernel refuses: the loop below
                pass
        return torch.cat([x[a:b] @ w[g].t() for g, (a, b) in enumerate(_segments(counts))])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *leaves = ctx.saved_tensors
        w = torch.stack(leaves)
        counts = ctx.counts
        dy = dy.contiguous()
        segs = _segments(counts)
        grouped = _grouped_mm_usable(x, w) and _grouped_mm_usable(dy, w.transpose(-2, -1))
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        dx = None
        if grouped:
            try:
                dx = torch._grouped_mm(dy, w, offs=offs)
            except RuntimeError:  # as in forward
                grouped = False
        if dx is None:
            dx = torch.cat([dy[a:b] @ w[g] for g, (a, b) in enumerate(segs)])

        def weight_grads() -> list[torch.Tensor]:
            if grouped:
                return list(torch._grouped_mm(dy.t(), x, offs=offs).unbind(0))
            return [dy[a:b].t() @ x[a:b] for a, b in segs]

        dws = run_or_defer_group(leaves, weight_grads)  # W of a zero-bubble schedule
        return (dx, None, *(dws if dws is not None else [None] * len(leaves)))


def grouped_linear(x: torch.Tensor, w: Sequence[torch.Tensor] | torch.Tensor, counts: list[int]
                   ) -> torch.Tensor:
    """``x[seg g] @ w[g]^T`` for each local expert ``g``; ``w`` lists their weights (or stacks
    them: its gradient then flows through the stack)."""
    out: torch.Tensor = _GroupedLinear.apply(x, counts, *w)  # type: ignore[no-untyped-call]
    return out


class Experts(nn.Module):
    """The local experts ``[first, first + count)`` of a layer's ``num_experts``.

    ``forward(x, counts)``: ``x`` holds the tokens sorted by local expert, ``counts[i]`` rows
    for local expert ``i``; returns each row through its expert (no routing weight applied).
    With expert tensor parallelism (``etp_group`` of more than one rank) each expert is this
    rank's slice and the result is a partial output, to be summed over the group.
    """

    def __init__(self, config: ModelConfig, first: int, count: int, *,
                 dtype: torch.dtype = torch.float32, grouped_gemm: bool = False,
                 etp_group: Group = None, etp_rank: int = 0, etp_size: int = 1):
        super().__init__()
        moe = config.moe
        self.config = config
        self.ffn = moe.moe_ffn_hidden_size or config.ffn_size
        self.first = first
        self.grouped_gemm = grouped_gemm
        self.etp_group = etp_group
        self.local_experts = nn.ModuleDict({
            str(e): scope(ExpertMLP(config, self.ffn, dtype, etp_rank, etp_size), str(e))
            for e in range(first, first + count)})
        # fc1's and fc2's GEMMs when a precision transform (megazero.fp8) replaces them: each
        # expert then runs through them one by one (the grouped GEMM's dense fallback)
        self.gemms: tuple[Gemm, Gemm] | None = None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = [cast(ExpertMLP, e) for e in self.local_experts.values()]
        if self.grouped_gemm and self.gemms is None:
            return self._grouped(x, counts, experts)
        outs = []
        for expert, (a, b) in zip(experts, _segments(counts), strict=True):
            fc1 = expert.linear_fc1
            gemm1, gemm2 = self.gemms or (DEFAULT_GEMM, DEFAULT_GEMM)
            h = LinearSavingWeight.apply(  # type: ignore[no-untyped-call]
                x[a:b], fc1.weight, gemm1)
            h = activation(h if fc1.bias is None else h + fc1.bias, self.config)
            y = LinearSavingWeight.apply(  # type: ignore[no-untyped-call]
                h, expert.linear_fc2.weight, gemm2)
            if expert.linear_fc2.bias is not None:
                y = add_once(y, expert.linear_fc2.bias, self.etp_group)
            outs.append(y)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def _grouped(self, x: torch.Tensor, counts: list[int], experts: list[ExpertMLP]
                 ) -> torch.Tensor:
        w1 = [e.linear_fc1.weight for e in experts]
        w2 = [e.linear_fc2.weight for e in experts]
        h = grouped_linear(x, w1, counts)
        if self.config.add_bias_linear:
            h = h + self._per_row_bias([e.linear_fc1.bias for e in experts], counts)
        h = activation(h, self.config)
        y = grouped_linear(h, w2, counts)
        if self.config.add_bias_linear:
            y = add_once(y, self._per_row_bias([e.linear_fc2.bias for e in experts], counts),
                         self.etp_group)
        return y

    @staticmethod
    def _per_row_bias(biases: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
        index = torch.repeat_interleave(torch.arange(len(counts), device=biases[0].device),
                                        torch.tensor(counts, device=biases[0].device))
        return torch.stack(biases)[index]
