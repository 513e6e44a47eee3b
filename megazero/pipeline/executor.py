"""Run one rank's pipeline schedule: the only code that touches tensors for the schedules.

:func:`forward_backward` builds this rank's step list (:mod:`megazero.pipeline.schedules`) and
dispatches it: ``F`` runs a model chunk and keeps its input and output for the backward, ``B``
back-propagates the received output grad, and communication steps go through :class:`P2P`.

Training-loop order for one iteration::

    losses = forward_backward(chunks, data_iter, topo, m, seq, mbs, hidden,
                              sequence_parallel=sp, grad_sync=engine)
    engine.finish_grad_sync()
    engine.step()

``grad_sync`` is a :class:`megazero.pipeline.grad_sync.GradSync` (the ZeRO engine, stage 0 without
ZeRO): ``no_sync()`` wraps every backward but each chunk's last, ``start_grad_sync()`` launches
the reduction of what is left, and ``finish_grad_sync()`` (the caller's) completes it together
with the sequence-parallel and tied-embedding sums. Without one (``grad_sync=None``, e.g.
forward-only evaluation) the grads are left as each rank's local, unsummed contributions.

Losses: every micro-batch's loss is the mean over its tokens; the backward uses it divided by
the number of micro-batches, so the accumulated grads equal those of one model run on all
micro-batches concatenated. The per-micro-batch means are returned on every pipeline rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch.autograd import Variable

from megazero.combined_1f1b.duet import run_pair
from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.activation_meter import ActivationMeter
from megazero.pipeline.combined import pair_at
from megazero.pipeline.grad_sync import GradSync
from megazero.pipeline.p2p import P2P, tensor_shape
from megazero.pipeline.schedules import stage_owner, virtual_stage
from megazero.pipeline.zero_bubble import placement_of, schedule_steps
from megazero.tensor_parallel import weight_grad

GradSyncArg: TypeAlias = "GradSync | Sequence[GradSync] | None"


def deallocate_output_tensor(out: torch.Tensor) -> None:
    """Free an activation's storage once it has been sent, keeping its autograd graph.

    The next stage owns a copy and will send back its grad; until then only ``out.grad_fn`` is
    needed (the backward runs from it). Replacing ``.data`` by a one-element tensor frees
    ``s*b*h`` elements per in-flight micro-batch while keeping ``out`` a valid graph root.
    Because ``out`` no longer has its real shape, the backward must skip autograd's shape check
    (see :func:`backward_step`).
    """
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def backward_step(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``torch.autograd.backward(output, grad)`` that accepts a deallocated ``output``.

    ``torch.autograd.backward`` checks that ``grad`` has ``output``'s shape, which fails after
    :func:`deallocate_output_tensor`; calling the autograd engine directly skips that check
    (the graph itself still knows the real shape).
    """
    if grad is None:
        torch.autograd.backward(output)
        return
    Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)


def _viewless(t: torch.Tensor) -> torch.Tensor:
    """An output that is a view would keep its base alive after deallocation; copy it out."""
    return t.clone() if t._base is not None else t


def _sync_objects(grad_sync: GradSyncArg, num_chunks: int) -> list[GradSync] | None:
    if grad_sync is None:
        return None
    if isinstance(grad_sync, Sequence):
        if len(grad_sync) != num_chunks:
            raise ValueError(f"grad_sync has {len(grad_sync)} entries for {num_chunks} chunks")
        return list(grad_sync)
    return [grad_sync] * num_chunks


#: Batch entries the first chunk takes as keyword inputs when present.
MODEL_INPUTS = ("doc_position_ids", "document_ids")


def default_get_batch(data_iterator: Iterator) -> dict[str, torch.Tensor]:
    return next(data_iterator)


def default_loss_fn(per_token_loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over the micro-batch's tokens, honouring an optional ``loss_mask``."""
    mask = batch.get("loss_mask")
    loss = per_token_loss.float()
    if mask is None:
        return loss.mean()
    mask = mask.float()
    return (loss * mask).sum() / mask.sum()


def forward_backward(
    model_chunks: Sequence[torch.nn.Module],
    data_iterator: Iterator | Sequence[Iterator],
    topo: ParallelTopology,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    *,
    forward_only: bool = False,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    loss_fn: Callable[[torch.Tensor, dict], torch.Tensor] = default_loss_fn,
    get_batch: Callable[[Iterator], dict[str, torch.Tensor]] = default_get_batch,
    grad_sync: GradSyncArg = None,
    activation_meter: ActivationMeter | None = None,
    microbatch_group_size: int | None = None,
    schedule: str | None = None,
    delay_wgrad: bool = False,
    combined: bool = False,
) -> list[float]:
    """Run one iteration of the pipeline schedule on this rank; return per-micro-batch losses.

    ``data_iterator`` yields one dict per micro-batch (``tokens`` and ``labels`` [b, s],
    optionally ``loss_mask``) through ``get_batch``; only the ranks holding the first or the
    last virtual stage draw from it. A list gives each chunk its own iterator (Megatron's
    interleaved convention); a single iterator is shared, one draw per micro-batch.

    ``grad_sync``: ``None``, a :class:`megazero.pipeline.grad_sync.GradSync`, or a list of them,
    one per chunk. Every backward except each chunk's last micro-batch runs inside ``no_sync()``; a
    per-chunk object gets ``start_grad_sync()`` right after its chunk's last backward (so
    reduction of early-finished chunks overlaps with the rest of the cool-down), a single shared
    object once after the schedule. The caller completes the sync with ``finish_grad_sync()``.
    ``microbatch_group_size``: the interleaved schedule's group size N (micro-batches that go
    through a model chunk in a row; default pp), see
    :func:`megazero.pipeline.schedules.interleaved_one_f_one_b`.
    ``activation_meter``, if given, measures this iteration's saved activations (see
    :class:`megazero.pipeline.activation_meter.ActivationMeter`).
    ``schedule``: a ``--pipeline-schedule`` name (``None``: 1F1B, or interleaved with vpp);
    ``delay_wgrad`` (Megatron's ``--delay-wgrad-compute``) runs 1F1B with each W after its
    backward's communication. A schedule with ``W`` actions runs each backward as B (the input
    gradient) with the weight gradients left to a store per (chunk, micro-batch), and W runs
    the store (:mod:`megazero.tensor_parallel.weight_grad`): the gradient sync then sees each
    micro-batch's gradients at its W, inside ``no_sync()`` but for each chunk's last.
    In the V placement (ZBV, DualPipeV) the last rank hands each activation from its chunk 0
    to its chunk 1 and the grad back without a message, and rank 0 holds the loss.
    ``combined`` (``--overlap-moe-expert-parallel-comm``): each forward that the schedule puts
    right before a backward of another micro-batch runs with it in turns, the backward here
    and the forward on a helper thread, handing over at every MoE all-to-all
    (:mod:`megazero.combined_1f1b`); same gradients, accumulated in the same order.
    """
    vpp, pp, m = len(model_chunks), topo.pp_size, num_microbatches
    if vpp != (topo.vpp_size or 1):
        raise ValueError(f"{vpp} model chunks but the topology has vpp={topo.vpp_size}")
    params = [p for c in model_chunks for p in c.parameters()]
    device = params[0].device if params else torch.device("cpu")
    steps = schedule_steps(pp, vpp, m, topo.pp_rank, forward_only, microbatch_group_size,
                           schedule, delay_wgrad, combined)
    p2p = P2P(topo, tensor_shape(seq_length, micro_batch_size, hidden_size, topo.tp_size,
                                 sequence_parallel), dtype, device)
    placement = placement_of(schedule)
    vstages = [virtual_stage(topo.pp_rank, c, pp, placement) for c in range(vpp)]
    first = [v == 0 for v in vstages]
    last = [v == pp * vpp - 1 for v in vstages]
    # the chunk of this rank that takes this chunk's output (V: the last rank feeds itself)
    local_next = [stage_owner(v + 1, pp, placement)[1]
                  if v + 1 < pp * vpp and stage_owner(v + 1, pp, placement)[0] == topo.pp_rank
                  else None for v in vstages]
    local_prev = [stage_owner(v - 1, pp, placement)[1]
                  if v > 0 and stage_owner(v - 1, pp, placement)[0] == topo.pp_rank
                  else None for v in vstages]
    split = any(st[0].kind == "W" for st in steps)
    chunk_params = [[p for p in c.parameters() if p.requires_grad] for c in model_chunks]
    w_stores: dict[tuple[int, int], weight_grad.WeightGradStore] = {}
    loss_rank = stage_owner(pp * vpp - 1, pp, placement)[0]
    syncs = _sync_objects(grad_sync, vpp)
    meter = activation_meter
    if meter is not None:
        meter.start(params)

    batches: dict[tuple[int, int], dict] = {}
    shared_draws: list[dict] = []

    def batch(chunk: int, mb: int) -> dict:
        if not isinstance(data_iterator, Iterator) and isinstance(data_iterator, Sequence):
            if (chunk, mb) not in batches:
                batches[(chunk, mb)] = get_batch(data_iterator[chunk])
            return batches.pop((chunk, mb))
        while len(shared_draws) <= mb:  # micro-batches are first needed in increasing order
            shared_draws.append(get_batch(data_iterator))
        return shared_draws[mb]

    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    outgoing: dict[tuple[str, int, int], torch.Tensor] = {}
    recv_act: dict[tuple[int, int], torch.Tensor] = {}
    recv_grad: dict[tuple[int, int], torch.Tensor] = {}
    losses: list[torch.Tensor | None] = [None] * m

    def run_forward(c: int, mb: int) -> None:
        x = None if first[c] else recv_act.pop((c, mb))
        if x is not None and not forward_only:
            x.requires_grad_(True)
        data = batch(c, mb) if (first[c] or last[c]) else {}
        tokens = data.get("tokens") if first[c] else None
        labels = data.get("labels") if last[c] else None
        meter_ctx = meter.forward((c, mb)) if meter else contextlib.nullcontext()
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_ctx, meter_ctx:
            # packed documents (megazero.model.packed): the batch's own positions and ids
            extra = {k: data[k] for k in MODEL_INPUTS if k in data} if first[c] else {}
            out = model_chunks[c](tokens, labels, hidden_states=x, **extra)
            if last[c]:
                loss = loss_fn(out, data)
                losses[mb] = loss.detach()
                out = loss / m
        nxt = local_next[c]
        if forward_only:
            if nxt is not None:
                recv_act[(nxt, mb)] = out.detach()
            elif not last[c]:
                outgoing[("SEND_F", c, mb)] = out
            return
        inputs[(c, mb)] = x
        if nxt is not None:  # no message: the next chunk's input is this output's value
            recv_act[(nxt, mb)] = out.detach()
        elif not last[c]:
            out = _viewless(out)
            outgoing[("SEND_F", c, mb)] = out
        outputs[(c, mb)] = out

    def run_backward(c: int, mb: int) -> None:
        out, x = outputs.pop((c, mb)), inputs.pop((c, mb))
        grad = None if last[c] else recv_grad.pop((c, mb))
        if split:  # B: the input grad now, the weight grads to the store for W
            store = weight_grad.WeightGradStore(chunk_params[c])
            with weight_grad.deferring(store):
                got = weight_grad.backward([out], [grad], [] if x is None else [x])
            x_grad = got[0] if got else None
            w_stores[(c, mb)] = store
        else:
            with _sync_context(c, mb):
                backward_step(out, grad)
            _after_last_grads(c, mb)
            x_grad = x.grad if x is not None else None
        if meter:
            meter.backward_done((c, mb))
        if not first[c]:
            assert x_grad is not None
            if local_prev[c] is not None:
                recv_grad[(local_prev[c], mb)] = x_grad
            else:
                outgoing[("SEND_B", c, mb)] = x_grad

    def _sync_context(c: int, mb: int) -> contextlib.AbstractContextManager:
        last_mb = mb == m - 1
        return syncs[c].no_sync() if (syncs and not last_mb) else contextlib.nullcontext()

    def _after_last_grads(c: int, mb: int) -> None:
        if syncs and mb == m - 1 and isinstance(grad_sync, Sequence):
            syncs[c].start_grad_sync()

    def run_weight(c: int, mb: int) -> None:
        with _sync_context(c, mb):
            w_stores.pop((c, mb)).run()
        _after_last_grads(c, mb)

    i = 0
    while i < len(steps):
        step, i = steps[i], i + 1
        a = step[0]
        pair = pair_at(steps, i - 1) if combined and not forward_only else None
        if pair is not None:
            f, b = pair
            run_pair(functools.partial(run_forward, f.chunk, f.microbatch),
                     functools.partial(run_backward, b.chunk, b.microbatch))
            i += 1
        elif a.kind == "F":
            run_forward(a.chunk, a.microbatch)
        elif a.kind == "B":
            run_backward(a.chunk, a.microbatch)
        elif a.kind == "W":
            run_weight(a.chunk, a.microbatch)
        else:
            got = p2p.exchange(step, outgoing)
            for b in step:
                key = (b.kind, b.chunk, b.microbatch)
                if b.kind == "RECV_F":
                    recv_act[(b.chunk, b.microbatch)] = got[key]
                elif b.kind == "RECV_B":
                    recv_grad[(b.chunk, b.microbatch)] = got[key]
                else:
                    sent = outgoing.pop(key)
                    if b.kind == "SEND_F" and not forward_only:
                        deallocate_output_tensor(sent)
            if meter:
                meter.held_outputs(outputs)
    assert not outputs and not inputs and not recv_act and not recv_grad and not w_stores, \
        "schedule left work"
    if syncs and not isinstance(grad_sync, Sequence) and not forward_only:
        syncs[0].start_grad_sync()
    return _broadcast_losses(losses, topo, device, loss_rank)


def _broadcast_losses(losses: list[torch.Tensor | None], topo: ParallelTopology,
                      device: torch.device, loss_rank: int) -> list[float]:
    """The last stage (``loss_rank``) has the losses; every pipeline rank returns them."""
    if topo.pp_rank == loss_rank:
        buf = torch.stack([t.float() for t in losses]).to(device)  # type: ignore[misc]
    else:
        buf = torch.empty(len(losses), dtype=torch.float32, device=device)
    if topo.pp_size > 1:
        c = topo.coord
        dist.broadcast(buf, src=topo.layout.rank(loss_rank, c.dp, c.tp, topo.cp_rank),
                       group=topo.pp_group)
    return buf.tolist()
