"""Gradient sums that the pipeline owes after the backward of all micro-batches.

Order for one iteration: the schedule accumulates local grads, then :func:`finalize_model_grads`
adds (1) the sequence-parallel params' grads over the tensor-parallel group and (2) the tied
word-embedding grads over the embedding group (first and last stage), then the data-parallel
reduction (the ZeRO engine; ``dp_reduce``) runs. All three are sums, so doing (1) and (2) on the
full local grads before the data-parallel reduction gives the same result as any other order.
The embedding sum must not run inside the backward: the first stage finishes its backwards
long after the last stage, and a collective between them in mid-schedule would deadlock.

Grads are read from ``param.main_grad`` when a wrapper keeps them there (an fp32 accumulation
buffer), otherwise from ``param.grad``.

A data-parallel engine may own these sums instead: ``megazero.zero``'s optimizer keeps
``sequence_parallel`` and ``shared_embedding`` grads in deferred buckets and sums them in its
``finish_grad_sync()`` before its own reduction (a reduce-scatter would reorder them). Pass such
an engine as ``grad_sync``: :func:`finalize_model_grads` then calls ``finish_grad_sync()`` and
does not sum again (summing twice would double those grads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megazero.config.rules import sequence_parallel_active
from megazero.topology import ParallelTopology


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
    return g


def _params(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [p for c in model_chunks for p in c.parameters()]


def shared_embedding_params(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Params marked ``shared_embedding``: the word embedding and the last stage's copy."""
    return [p for p in _params(model_chunks) if getattr(p, "shared_embedding", False)]


def _allreduce_coalesced(tensors: Iterable[torch.Tensor], group) -> None:
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def allreduce_embedding_grads(model_chunks: Sequence[torch.nn.Module],
                              topo: ParallelTopology) -> None:
    """Sum the tied embedding grads of the first and last stage (no-op when pp = 1, where the
    one shared parameter already got both contributions)."""
    if topo.pp_size == 1 or not topo.in_embedding_group:
        return
    params = shared_embedding_params(model_chunks)
    if len(params) > 1:
        raise RuntimeError(f"{len(params)} shared_embedding params on one rank; expected one")
    _allreduce_coalesced([_grad(p) for p in params], topo.embedding_group)


def finalize_model_grads(
    model_chunks: Sequence[torch.nn.Module],
    topo: ParallelTopology,
    *,
    sequence_parallel: bool = False,
    dp_reduce: Callable[[], None] | None = None,
    grad_sync: Any = None,
) -> None:
    """Sequence-parallel sums over TP, tied-embedding sums over the embedding group, then the
    optional data-parallel reduction ``dp_reduce()``. Call on every rank after the schedule.

    With a ``grad_sync`` engine that has ``finish_grad_sync()`` (or a list of them, one per
    chunk; see the module docstring), that call replaces all three.
    """
    engines = list(grad_sync) if isinstance(grad_sync, Sequence) else [grad_sync]
    engines = [e for e in engines if e is not None]
    if engines and all(hasattr(e, "finish_grad_sync") for e in engines):
        for e in {id(e): e for e in engines}.values():  # one call per distinct engine
            e.finish_grad_sync()
        return
    if sequence_parallel_active(sequence_parallel, topo.tp_size):
        from megazero.tensor_parallel.grads import allreduce_sequence_parallel_grads

        allreduce_sequence_parallel_grads(_params(model_chunks), topo)
    allreduce_embedding_grads(model_chunks, topo)
    if dp_reduce is not None:
        dp_reduce()


@torch.no_grad()
def sync_tied_embeddings(model_chunks: Sequence[torch.nn.Module], topo: ParallelTopology) -> None:
    """Make the last stage's copy of the word embedding equal to the first stage's.

    The model initialises both copies identically from the seed; this broadcast makes that a
    guarantee (e.g. after loading a checkpoint written with another layout).
    """
    if topo.pp_size == 1 or not topo.in_embedding_group:
        return
    params = shared_embedding_params(model_chunks)
    c = topo.coord
    src = topo.layout.rank(0, c.dp, c.tp)
    for p in params:
        dist.broadcast(p.data, src=src, group=topo.embedding_group)
