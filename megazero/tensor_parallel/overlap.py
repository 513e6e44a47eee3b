"""Sequence-parallel GEMMs with their collective inside (Megatron's ``--tp-comm-overlap``).

With sequence parallelism every column-parallel linear starts with an all-gather of its input
along the sequence and every row-parallel linear ends with a reduce-scatter of its output; run
as plain collectives they sit between two GEMMs and nothing hides them. Here each is split into
``tp`` chunks along the sequence and pipelined with the GEMM around a ring of point-to-point
exchanges (``batch_isend_irecv``, so NCCL and gloo alike, and one send plus one receive in
flight per step):

* **all-gather + GEMM** (:func:`ring_all_gather_apply`): at step ``i`` a rank multiplies the
  sequence chunk it holds (its own at step 0, then the one from ``i`` ranks back) while that
  chunk travels on to the next rank. Column-parallel forward; row-parallel backward (the output
  gradient's all-gather under the input-gradient GEMM); and, under weight-gradient deferral,
  the W pass of a column-parallel linear (the input's all-gather under the chunked wgrad GEMM).
* **GEMM + reduce-scatter** (:func:`ring_matmul_reduce_scatter`): the partial product of
  sequence chunk ``k`` starts at rank ``k + 1`` and travels the ring, each rank adding its own
  partial of that chunk while computing the next one, so it arrives summed at rank ``k``.
  Row-parallel forward; column-parallel backward's input gradient with ``rs_dgrad``.
* **bulk overlap** (column-parallel backward, as Transformer Engine's ``bulk_dgrad`` /
  ``bulk_wgrad``): the input all-gather the weight gradient needs runs asynchronously under the
  input-gradient GEMM, then the input gradient's reduce-scatter under the weight-gradient GEMM.

Under :func:`megazero.tensor_parallel.weight_grad.deferring` (a zero-bubble B) the weight
gradient is not computed in the backward, so the input gradient's reduce-scatter has no wgrad
GEMM to hide under: B pipelines it with the chunked dgrad GEMM instead, and W hides the input's
all-gather under its own chunked wgrad GEMM. Every path computes the same products as
:class:`~megazero.tensor_parallel.layers.LinearWithTensorParallelInput` and the row-parallel
linear, in chunks and in a different summation order: equal to fp32 rounding.

:func:`recording` times every collective (issue to completion) and GEMM of these functions,
for the test that proves the collectives are in flight while a GEMM runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.config.sections import ParallelConfig
from megazero.distributed import collectives
from megazero.tensor_parallel.mappings import Group, group_rank, group_size
from megazero.tensor_parallel.weight_grad import current as deferring_store
from megazero.tensor_parallel.weight_grad import run_or_defer


@dataclass(frozen=True)
class TPCommOverlap:
    """Which collectives run inside the GEMMs (Megatron's per-part switches).

    ``ag``: the forward all-gather of column-parallel inputs (and the row-parallel backward's
    gradient all-gather) as ring steps under the GEMM chunks. ``rs``: the row-parallel
    forward's reduce-scatter pipelined with the GEMM. ``rs_dgrad``: the column-parallel input
    gradient's reduce-scatter pipelined with the dgrad GEMM (instead of ``bulk_wgrad``).
    ``bulk_dgrad``: the input all-gather for the weight gradient under the dgrad GEMM.
    ``bulk_wgrad``: the input gradient's reduce-scatter under the wgrad GEMM."""

    ag: bool = True
    rs: bool = True
    rs_dgrad: bool = False
    bulk_dgrad: bool = True
    bulk_wgrad: bool = True


def tp_comm_overlap_of(parallel: ParallelConfig) -> TPCommOverlap | None:
    """The overlap a run's ``--tp-comm-overlap*`` flags ask for (None: the flag is off)."""
    if not parallel.tp_comm_overlap:
        return None
    return TPCommOverlap(ag=parallel.tp_comm_overlap_ag, rs=parallel.tp_comm_overlap_rs,
                         rs_dgrad=parallel.tp_comm_overlap_rs_dgrad,
                         bulk_dgrad=parallel.tp_comm_bulk_dgrad,
                         bulk_wgrad=parallel.tp_comm_bulk_wgrad)


#: Every switch off: the same chunk-free computation as the plain layers, with each collective
#: issued and waited for at once (what the in-flight test compares against).
NO_OVERLAP = TPCommOverlap(ag=False, rs=False, rs_dgrad=False, bulk_dgrad=False,
                           bulk_wgrad=False)


# --- timing ----------------------------------------------------------------------------------

@dataclass
class OverlapTrace:
    """``comms``: ``(name, issued, completed)``; ``gemms``: ``(started, ended)``; seconds of
    ``time.perf_counter`` on this rank."""

    comms: list[tuple[str, float, float]] = field(default_factory=list)
    gemms: list[tuple[float, float]] = field(default_factory=list)

    def hidden_shares(self) -> list[tuple[str, float]]:
        """Per collective, the share of its time in flight on this rank (issue to the return
        of its wait) during which a GEMM of this rank ran. A collective issued and waited for
        at once has none; one waited for after a GEMM has that GEMM's time, less the issue's
        and the wait's (on a loaded host also the wait for a slower peer)."""
        merged: list[list[float]] = []  # nested computes (a GEMM inside a traced block) once
        for g0, g1 in sorted(self.gemms):
            if merged and g0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], g1)
            else:
                merged.append([g0, g1])
        out = []
        for name, t0, t1 in self.comms:
            covered = sum(max(0.0, min(t1, g1) - max(t0, g0)) for g0, g1 in merged)
            out.append((name, covered / max(t1 - t0, 1e-12)))
        return out

_trace: list[OverlapTrace] = []


@contextlib.contextmanager
def recording() -> Iterator[OverlapTrace]:
    """Record the collectives and GEMMs of this module's functions while inside."""
    trace = OverlapTrace()
    _trace.append(trace)
    try:
        yield trace
    finally:
        _trace.remove(trace)


def compute(fn: Callable[[], Any]) -> Any:
    """``fn()``, traced as compute (a GEMM) while :func:`recording`."""
    if not _trace:
        return fn()
    t0 = time.perf_counter()
    out = fn()
    _trace[-1].gemms.append((t0, time.perf_counter()))
    return out


def compute_window(t0: float, t1: float) -> None:
    """Trace ``[t0, t1]`` as compute while :func:`recording` (the other micro-batch's turn of
    a combined 1F1B pair, :mod:`megazero.combined_1f1b.duet`)."""
    if _trace:
        _trace[-1].gemms.append((t0, t1))


class InFlight:
    """An asynchronous collective being traced: its work handles, its issue time, and a
    ``finish`` run after the wait."""

    def __init__(self, name: str, works: list[Any], t0: float,
                 finish: Callable[[], None] | None = None):
        self.name, self.works, self.finish, self.t0 = name, works, finish, t0

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        if self.finish is not None:
            self.finish()
        if _trace:
            _trace[-1].comms.append((self.name, self.t0, time.perf_counter()))


def _ring_step(send: torch.Tensor, recv: torch.Tensor, group: Group, name: str) -> InFlight:
    """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous."""
    r, t = group_rank(group), group_size(group)
    nxt = dist.get_global_rank(group, (r + 1) % t)
    prev = dist.get_global_rank(group, (r - 1) % t)
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
    t0 = time.perf_counter()
    return InFlight(name, list(dist.batch_isend_irecv(ops)), t0)


def all_gather_async(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, InFlight]:
    """Start the sequence all-gather of ``x``; the gathered tensor is valid after ``wait``."""
    x = x.contiguous()
    out = torch.empty((group_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    t0 = time.perf_counter()
    work = collectives.all_gather(out, x, group, async_op=True)
    return out, InFlight("all_gather", [work], t0)


def reduce_scatter_async(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, InFlight]:
    """Start the sequence reduce-scatter of ``x``; the result is valid after ``wait``."""
    x = x.contiguous()
    t = group_size(group)
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    impl = collectives.reduce_scatter_impl("auto", collectives.backend_of(group))
    t0 = time.perf_counter()
    issued = collectives.reduce_scatter(out, x, group, impl, async_op=True)
    return out, InFlight("reduce_scatter", [issued.work], t0, issued.finish)


# --- the two ring patterns -------------------------------------------------------------------

def ring_all_gather_apply(x: torch.Tensor, fn: Callable[[int, torch.Tensor], None],
                          group: Group, name: str = "ring_all_gather") -> None:
    """Call ``fn(k, chunk_k)`` for every rank ``k``'s ``x`` (its sequence chunk), each call
    running while the chunk it was given travels on to the next rank."""
    t, r = group_size(group), group_rank(group)
    cur = x.contiguous()
    for i in range(t):
        step = None
        if i < t - 1:
            nxt = torch.empty_like(cur)
            step = _ring_step(cur, nxt, group, name)
        fn((r - i) % t, cur)
        if step is not None:
            step.wait()
            cur = nxt


def ring_matmul_reduce_scatter(partial: Callable[[int], torch.Tensor], group: Group,
                               name: str = "ring_reduce_scatter") -> torch.Tensor:
    """``sum over ranks of partial(r)`` for this rank's chunk ``r``, where ``partial(k)`` is this
    rank's contribution to sequence chunk ``k``; each partial is computed while the running
    sum of the previous chunk travels to the next rank."""
    t, r = group_size(group), group_rank(group)
    acc = partial((r - 1) % t).contiguous()
    for i in range(1, t):
        incoming = torch.empty_like(acc)
        step = _ring_step(acc, incoming, group, name)
        mine = partial((r - 1 - i) % t)
        step.wait()
        acc = incoming + mine
    return acc


# --- the autograd functions ------------------------------------------------------------------

def _sync_all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    out, fl = all_gather_async(x, group)
    fl.wait()
    return out


def _sync_reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    out, fl = reduce_scatter_async(x, group)
    fl.wait()
    return out


def _wgrad(grad: torch.Tensor, x: torch.Tensor, wdtype: torch.dtype) -> torch.Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    return compute(lambda: g2.t().matmul(x.reshape(-1, x.shape[-1]).to(grad.dtype))).to(wdtype)


def _deferred(weight: torch.Tensor) -> bool:
    return deferring_store() is not None and weight.is_leaf and weight.requires_grad


class AllGatherLinear(torch.autograd.Function):
    """Column-parallel ``y = all_gather(x) @ W^T + b`` with the all-gather inside the GEMM;
    saves only this rank's sequence slice of ``x`` (as the plain layer)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, cfg):
        ctx.group, ctx.cfg = group, cfg
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight)
        if not cfg.ag:
            total = _sync_all_gather(x, group)
            return compute(lambda: F.linear(total, weight, bias))
        outs: list[torch.Tensor | None] = [None] * group_size(group)

        def step(k: int, chunk: torch.Tensor) -> None:
            outs[k] = compute(lambda: F.linear(chunk, weight, bias))

        ring_all_gather_apply(x, step, group, "ag_fwd")
        return torch.cat(outs, 0)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, cfg = ctx.group, ctx.cfg
        s = x.shape[0]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        wdtype, w = weight.dtype, weight.to(grad.dtype)
        deferred = want_w and _deferred(weight)
        pipelined = cfg.rs_dgrad or (deferred and cfg.bulk_wgrad)
        if want_w and not deferred and not pipelined:
            # Bulk overlap: the input all-gather under the dgrad GEMM, the dgrad's
            # reduce-scatter under the wgrad GEMM.
            total, ag = all_gather_async(x, group)
            if not cfg.bulk_dgrad:
                ag.wait()
            dgrad = compute(lambda: grad.matmul(w)) if want_x else None
            if cfg.bulk_dgrad:
                ag.wait()
            rs = None
            if dgrad is not None:
                grad_x, rs = reduce_scatter_async(dgrad, group)
                if not cfg.bulk_wgrad:
                    rs.wait()
            grad_w = _wgrad(grad, total, wdtype)
            if rs is not None and cfg.bulk_wgrad:
                rs.wait()
        else:
            if want_x:
                if pipelined:
                    grad_x = ring_matmul_reduce_scatter(
                        lambda k: compute(lambda: grad[k * s:(k + 1) * s].matmul(w)), group,
                        "rs_dgrad")
                else:
                    grad_x = _sync_reduce_scatter(compute(lambda: grad.matmul(w)), group)
            if want_w:
                ring = cfg.bulk_dgrad

                def weight_grad() -> torch.Tensor:
                    if not ring:
                        return _wgrad(grad, _sync_all_gather(x, group), wdtype)
                    parts: list[torch.Tensor] = []

                    def step(k: int, chunk: torch.Tensor) -> None:
                        parts.append(_wgrad(grad[k * s:(k + 1) * s], chunk, torch.float32))

                    ring_all_gather_apply(x, step, group, "ag_wgrad")
                    return torch.stack(parts).sum(0).to(wdtype)

                grad_w = run_or_defer(weight, weight_grad)
        if grad_x is not None:
            grad_x = grad_x.to(x.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


class LinearReduceScatter(torch.autograd.Function):
    """Row-parallel ``y = reduce_scatter(x @ W^T)`` with the reduce-scatter inside the GEMM
    (the bias is added by the caller, after the reduction, as the plain layer does)."""

    @staticmethod
    def forward(ctx, x, weight, group, cfg):
        ctx.group, ctx.cfg = group, cfg
        ctx.save_for_backward(x, weight)
        t = group_size(group)
        s = x.shape[0] // t
        if x.shape[0] % t:
            raise ValueError(f"reduce-scatter: dim 0 ({x.shape[0]}) not divisible by {t} ranks")
        if not cfg.rs:
            return _sync_reduce_scatter(compute(lambda: F.linear(x, weight)), group)
        return ring_matmul_reduce_scatter(
            lambda k: compute(lambda: F.linear(x[k * s:(k + 1) * s], weight)), group, "rs_fwd")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, cfg = ctx.group, ctx.cfg
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(grad.dtype)
        grad_x = grad_w = None
        if cfg.ag and want_x:
            outs: list[torch.Tensor | None] = [None] * group_size(group)
            gathered: list[torch.Tensor | None] = [None] * group_size(group)

            def step(k: int, chunk: torch.Tensor) -> None:
                gathered[k] = chunk
                outs[k] = compute(lambda: chunk.matmul(w))

            ring_all_gather_apply(grad, step, group, "ag_dgrad")
            grad_x = torch.cat(outs, 0).to(x.dtype)
            total = torch.cat(gathered, 0)
        else:
            total = _sync_all_gather(grad, group)
            if want_x:
                grad_x = compute(lambda: total.matmul(w)).to(x.dtype)
        if want_w:
            wdtype = weight.dtype
            grad_w = run_or_defer(weight, lambda: _wgrad(total, x, wdtype))
        return grad_x, grad_w, None, None


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      group: Group, cfg: TPCommOverlap) -> torch.Tensor:
    """The column-parallel sequence-parallel linear, overlapped as ``cfg`` says."""
    return AllGatherLinear.apply(x, weight, bias, group, cfg)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group,
                          cfg: TPCommOverlap) -> torch.Tensor:
    """The row-parallel sequence-parallel linear (no bias), overlapped as ``cfg`` says."""
    return LinearReduceScatter.apply(x, weight, group, cfg)
