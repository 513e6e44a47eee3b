"""Tensor-parallel layers: column/row-parallel linear and the vocab-parallel embedding.

Activations use Megatron's ``[s, b, h]`` layout. Weights follow ``torch.nn.Linear``
(``[out, in]``); a column-parallel weight is split along dim 0 (outputs), a row-parallel weight
along dim 1 (inputs). Parameter metadata uses Megatron's attribute names, which the optimizer,
gradient reduction and checkpointing read:

* ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``: the parameter is this
  rank's slice of a full tensor along ``partition_dim``. With ``partition_stride = k`` the full
  tensor is ``k`` equal blocks along that dim (e.g. SwiGLU's ``[gate; up]``) and the slice is
  the concatenation of this rank's part of every block.
* ``sequence_parallel``: replicated across the TP group, but each rank only sees its sequence
  slice, so its gradient is partial and must be summed over the TP group.
* ``padded_vocab_size`` / ``vocab_size``: dim 0 of the full tensor is padded beyond
  ``vocab_size`` rows; the pad rows are zero, never looked up, and masked out of the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.mappings import (
    Group,
    all_gather_dim0,
    all_reduce,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_dim0,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megazero.tensor_parallel.overlap import all_gather_linear, linear_reduce_scatter
from megazero.tensor_parallel.utils import (
    divide,
    gather_from_tensor_parallel_output,
    shard_tensor,
)
from megazero.tensor_parallel.weight_grad import run_or_defer

InitMethod = Callable[[torch.Tensor], None]


#: ``(product without bias, bias or None) -> output``: a fused bias add and what follows.
Epilogue = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def normal_init(std: float = 0.02) -> InitMethod:
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, partition_dim: int, stride: int = 1
) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def DEFERRED_INIT(t: torch.Tensor) -> None:  # noqa: N802 - a sentinel, used by identity
    """``init_method`` meaning "leave the values to :func:`megazero.model.init`": the layer
    then never builds its full tensor (which would cost full-model memory on every rank)."""
    raise RuntimeError("DEFERRED_INIT is a marker; megazero.model.init fills the parameter")


def _init_shard(param: nn.Parameter, full_shape: tuple[int, ...], init: InitMethod,
                group: Group) -> None:
    """Initialise the full master tensor on CPU in fp32, keep this rank's slice.

    Every TP rank generates the same full tensor (same global RNG state assumed), so the
    shards are exactly the slices of the tp=1 weight. This path is for layers used on their
    own with an arbitrary ``init_method``; models pass :data:`DEFERRED_INIT` and
    :func:`megazero.model.init` computes only this rank's shard.
    """
    if init is DEFERRED_INIT:
        return
    full = torch.empty(full_shape, dtype=torch.float32)
    init(full)
    shard = shard_tensor(full, param.partition_dim, getattr(param, "partition_stride", 1),
                         group_rank(group), group_size(group))
    with torch.no_grad():
        param.copy_(shard)


class Gemm:
    """The three GEMMs of a linear: ``fprop(x, w, bias)`` (``x @ w^T + bias``), ``dgrad(dy,
    w)`` (``dy @ w``) and ``wgrad(dy2, x2)`` (``dy2^T @ x2``, both 2-D). The linears call
    them through their ``gemm`` attribute, so a precision transform (:mod:`megazero.fp8`)
    swaps one object per module and the communication around the GEMMs stays here. This
    default is the plain matmul in the operands' dtype."""

    def fprop(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        return F.linear(x, w, bias)

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return dy.matmul(w.to(dy.dtype))

    def wgrad(self, dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return dy2.t().matmul(x2.to(dy2.dtype))


DEFAULT_GEMM = Gemm()


class LinearWithTensorParallelInput(torch.autograd.Function):
    """``y = x_full @ W^T + b`` for a column-parallel weight.

    Without sequence parallelism ``x_full = x`` (replicated); backward all-reduces the input
    gradient because every rank only holds the part coming from its output columns.

    With sequence parallelism ``x`` is this rank's sequence slice: forward all-gathers it, but
    only the slice is saved, and backward all-gathers it again to form the weight gradient.
    That re-gather is what makes the saved activations of every column-parallel input 1/t of
    their size (Megatron's activation-memory accounting for TP+SP assumes it). The input
    gradient is reduce-scattered back onto the sequence slices.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, gemm):
        ctx.group, ctx.sequence_parallel, ctx.gemm = group, sequence_parallel, gemm
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight)
        total = all_gather_dim0(x, group) if sequence_parallel else x
        return gemm.fprop(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        grad_x = grad_w = grad_b = None
        # Casts keep backward valid when forward ran under autocast (saved x / weight in
        # their storage dtype, grad in the autocast dtype); they are no-ops otherwise.
        if ctx.needs_input_grad[0]:
            grad_x = ctx.gemm.dgrad(grad, weight)
            grad_x = reduce_scatter_dim0(grad_x, group) if ctx.sequence_parallel \
                else all_reduce(grad_x, group)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            sp, wdtype, gemm = ctx.sequence_parallel, weight.dtype, ctx.gemm

            def weight_grad() -> torch.Tensor:
                total = all_gather_dim0(x, group) if sp else x
                g2 = grad.reshape(-1, grad.shape[-1])
                return gemm.wgrad(g2, total.reshape(-1, total.shape[-1])).to(wdtype)

            grad_w = run_or_defer(weight, weight_grad)  # W of a zero-bubble schedule
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class LinearSavingWeight(torch.autograd.Function):
    """``y = x @ W^T`` that saves the weight parameter itself for backward.

    ``F.linear`` saves a transposed *view* of the weight: a view keeps the storage it was
    taken from, so a ZeRO-3 unit released after its forward (``param.data`` swapped for an
    empty tensor) would stay gathered until its backward. Saving the parameter lets the
    release free the gathered storage; the backward's re-gather puts it back (as DeepSpeed's
    ``LinearFunctionForZeroStage3``)."""

    @staticmethod
    def forward(ctx, x, weight, gemm):
        ctx.save_for_backward(x, weight)
        ctx.gemm = gemm
        return gemm.fprop(x, weight, None)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.gemm.dgrad(grad, weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            wdtype, gemm = weight.dtype, ctx.gemm

            def weight_grad() -> torch.Tensor:
                g2 = grad.reshape(-1, grad.shape[-1])
                return gemm.wgrad(g2, x.reshape(-1, x.shape[-1])).to(wdtype)

            grad_w = run_or_defer(weight, weight_grad)  # W of a zero-bubble schedule
        return grad_x, grad_w, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: Group, sequence_parallel: bool = False,
                           gemm: Gemm = DEFAULT_GEMM) -> torch.Tensor:
    return LinearWithTensorParallelInput.apply(x, weight, bias, group, sequence_parallel, gemm)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: rank ``r`` computes ``Y_r = X A_r + b_r``.

    ``gather_output`` all-gathers ``Y`` along the last dim; otherwise the output stays in the
    tensor-parallel region (the usual case, feeding a :class:`RowParallelLinear`). With
    ``parallel.sequence_parallel`` the input is ``[s/t, b, in]`` and is all-gathered along the
    sequence. ``parallel`` (group, SP, dtype) defaults to the single-process context.
    """

    def __init__(self, input_size: int, output_size: int, *,
                 parallel: ParallelContext | None = None, bias: bool = True,
                 gather_output: bool = False, partition_stride: int = 1,
                 init_method: InitMethod | None = None, device: torch.device | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        group, dtype = parallel.tp_group, parallel.params_dtype
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = parallel.sequence_parallel
        self.overlap = parallel.overlap
        self.input_size, self.output_size = input_size, output_size
        self.gemm: Gemm = DEFAULT_GEMM
        local = divide(output_size, parallel.tp_size)
        self.weight = nn.Parameter(torch.empty(local, input_size, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, 0, partition_stride)
        _init_shard(self.weight, (output_size, input_size), init_method or normal_init(), group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local, dtype=dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, 0, partition_stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, epilogue: Epilogue | None = None) -> torch.Tensor:
        """``epilogue(y, bias)``, when given, replaces the bias add: it adds the bias itself,
        fused with what follows (the MLP's bias-GELU). It runs inside this forward, where ZeRO-3
        holds the gathered bias (a caller adding ``self.bias`` afterwards would find it
        released)."""
        bias = None if epilogue is not None else self.bias
        if self.overlap is not None:
            y = all_gather_linear(x, self.weight, bias, self.group, self.overlap)
        else:
            y = column_parallel_linear(x, self.weight, bias, self.group, self.sequence_parallel,
                                       self.gemm)
        if epilogue is not None:
            if self.gather_output:
                raise ValueError("an epilogue needs gather_output=False (it acts on this "
                                 "rank's columns)")
            return epilogue(y, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_output(y, self.group,
                                                   self.weight.partition_stride)
        return y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows: rank ``r`` computes ``X_r A_r``, then the
    partial products are summed (all-reduce, or reduce-scatter onto sequence slices with
    ``sequence_parallel``). The bias is added once, after the reduction; under sequence
    parallelism its gradient is partial per rank, hence ``bias.sequence_parallel``.
    """

    def __init__(self, input_size: int, output_size: int, *,
                 parallel: ParallelContext | None = None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod | None = None,
                 device: torch.device | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        group, dtype = parallel.tp_group, parallel.params_dtype
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = parallel.sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel RowParallelLinear needs input_is_parallel=True")
        self.overlap = parallel.overlap
        self.input_size, self.output_size = input_size, output_size
        self.gemm: Gemm = DEFAULT_GEMM
        local = divide(input_size, parallel.tp_size)
        self.weight = nn.Parameter(torch.empty(output_size, local, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, 1)
        _init_shard(self.weight, (output_size, input_size), init_method or normal_init(), group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        # ``epilogue(y, bias)`` replaces the bias add for one call, set by the transformer
        # layer around its attention / MLP (whose forwards it does not change): the fused
        # bias-dropout-add. Inside this forward, so ZeRO-3 still holds the gathered bias.
        self.epilogue: Epilogue | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.overlap is not None:  # the reduce-scatter inside the GEMM
            y = linear_reduce_scatter(x, self.weight, self.group, self.overlap)
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(
                LinearSavingWeight.apply(x, self.weight, self.gemm), self.group)
        else:
            y = reduce_from_tensor_parallel_region(
                LinearSavingWeight.apply(x, self.weight, self.gemm), self.group)
        if self.epilogue is not None:
            return self.epilogue(y, self.bias)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the (padded) vocabulary.

    Rank ``r`` holds rows ``[r*V/t, (r+1)*V/t)`` of the padded table. Tokens outside that range
    produce zeros, so summing the outputs over the TP group gives the full lookup. The output
    is the *partial* sum unless ``reduce_output`` (then all-reduced), so a caller can choose
    all-reduce or reduce-scatter.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 parallel: ParallelContext | None = None, make_vocab_size_divisible_by: int = 128,
                 reduce_output: bool = True, init_method: InitMethod | None = None,
                 device: torch.device | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        group, tp = parallel.tp_group, parallel.tp_size
        self.group, self.reduce_output = group, reduce_output
        self.num_embeddings = num_embeddings
        self.padded_vocab_size = pad_vocab_size(num_embeddings, make_vocab_size_divisible_by, tp)
        local = self.padded_vocab_size // tp
        self.vocab_start = parallel.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, dtype=parallel.params_dtype,
                                               device=device))
        mark_vocab_parallel(self.weight, num_embeddings, self.padded_vocab_size)
        init_vocab_shard(self.weight, init_method or normal_init(), group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group) if self.reduce_output else out


def mark_vocab_parallel(param: torch.Tensor, vocab_size: int, padded_vocab_size: int) -> None:
    set_tensor_model_parallel_attributes(param, 0)
    param.vocab_size = vocab_size
    param.padded_vocab_size = padded_vocab_size


def init_vocab_shard(param: nn.Parameter, init: InitMethod, group: Group) -> None:
    """The full table is ``[vocab_size, h]`` (independent of tp); pad rows are zero."""
    if init is DEFERRED_INIT:
        return
    full = torch.empty(param.vocab_size, param.shape[1], dtype=torch.float32)
    init(full)
    load_full_into_shard(param, full, group)


def load_full_into_shard(param: nn.Parameter, full: torch.Tensor, group: Group) -> None:
    """Copy this rank's slice of an unpadded full tensor into ``param`` (zero pad rows)."""
    if getattr(param, "padded_vocab_size", None) is not None:
        pad = param.padded_vocab_size - full.shape[0]
        full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
    if getattr(param, "tensor_model_parallel", False):
        full = shard_tensor(full, param.partition_dim, getattr(param, "partition_stride", 1),
                            group_rank(group), group_size(group))
    with torch.no_grad():
        param.copy_(full)
