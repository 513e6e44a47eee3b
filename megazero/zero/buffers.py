"""Flat contiguous parameter and gradient buffers, cut into buckets that own their reduction.

One :class:`GradBuffer` holds the parameters of one model chunk (one dtype). The parameters'
``.data`` become views into one flat parameter buffer; the buffer is cut into buckets of about
``reduce_bucket_size`` elements, each padded to a multiple of the data-parallel size so that
reduce-scatter and all-gather split it into equal shards (rank ``r`` owns elements
``[r*S, (r+1)*S)`` of every bucket, ``S = bucket_numel / dp``).

Where the data-parallel group can use shared memory (one host, gloo), the gradient buffer of
stages 0-1 and the parameter buffer of stages 1-2 live there, and their reductions and the
parameters' all-gather run in it (:meth:`megazero.distributed.group_comm.GroupComm.shared_buffer`).

Gradients accumulate over micro-batches in the buffer's dtype (``grad_dtype``, fp32 for bf16
parameters by default: :attr:`megazero.config.PrecisionConfig.grad_dtype`). Where it is wider
than the parameters (*accumulate* mode, Megatron's ``main_grad``) every backward's
``param.grad`` is added into the bucket in that dtype, already divided by dp, and freed, inside
``no_sync`` too; a bf16 ``param.grad`` never holds more than one micro-batch's gradient, and the
reduction runs on the wide sums.

Gradients by stage:

* stage 0 / 1: a persistent flat gradient buffer. With ``contiguous_gradients`` (and the
  communication dtype equal to the parameter dtype) ``param.grad`` *is* a view into it, so
  autograd accumulates in place and no copy is made; otherwise the hook copies ``param.grad`` in
  and frees it. Stage 0 all-reduces each bucket; stage 1 reduce-scatters it (or all-reduces when
  ``reduce_scatter`` is false) and reads only its shard.
* stage 2: no full gradient buffer survives a micro-batch, as in DeepSpeed's ZeRO-2: gradients
  are partitioned across the accumulation window too. A bucket's full-size staging buffer is
  allocated (zeroed) when its first gradient arrives, reduce-scattered once full, added into a
  persistent shard buffer (``1/dp`` of the bucket), and freed; inside ``no_sync`` as well, so
  every micro-batch reduces its own gradients (``gradient_accumulation_steps`` times the
  traffic of stage 1, which accumulates full gradients and reduces them once). A bucket that
  does not fill in a micro-batch (an unused parameter) keeps adding into its staging buffer
  until it does, or until the step's flush.

Parameters whose gradients must first be summed over another group (``sequence_parallel``
parameters over tensor-parallel ranks when sequence parallelism is on, ``shared_embedding``
parameters over the embedding group when pp > 1) live in their own *deferred* buckets: a
reduce-scatter reorders elements by data-parallel shard, and those buckets sit at different
offsets on different pipeline stages, so the other sum has to happen on full gradients first.
:meth:`GradBuffer.finish` does it, after the in-flight buckets.

Parameters in ``apart`` (the weights of FP8 GEMMs under ``--fp8-param-gather``) get buckets of
their own too, which :meth:`GradBuffer.gather_with` may give a :class:`BucketCodec`: the
post-step all-gather of such a bucket moves its encoding (one byte per element, through a
buffer of its own) and every rank decodes it into the parameters, its own shard included.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megazero.distributed.group_comm import GroupComm, Handle
from megazero.zero.encoded_gather import BucketCodec, gather_encoded
from megazero.zero.pieces import Piece

#: Stage-2 reductions in flight at once (see GradBuffer.in_flight).
MAX_IN_FLIGHT = 1


@dataclass
class Slot:
    """Where one parameter sits: elements ``[start, start + numel)`` of its bucket."""

    param: nn.Parameter
    start: int
    numel: int


@dataclass
class Bucket:
    index: int
    slots: list[Slot]
    numel: int  # padded to a multiple of dp
    offset: int  # first element in the flat buffers
    shard_offset: int  # first element in the stage-2 shard buffer
    kind: str | None  # None, "sp" (sum over tp first) or "emb" (sum over embedding group first)
    apart: bool = False  # holds only parameters of ``apart`` (GradBuffer)
    own_lo: int = 0  # this rank's owned range inside the bucket
    own_hi: int = 0
    pending: set[int] = field(default_factory=set)
    filled: set[int] = field(default_factory=set)  # slots copied into ``grad`` this step
    launched: bool = False
    reductions: int = 0  # launched this step (stage 2 reduces every micro-batch)
    handle: Handle | None = None
    gather: Handle | None = None  # the parameters' all-gather in flight after the step
    grad: torch.Tensor | None = None  # full-size gradients (a view, or stage-2 staging)
    # this bucket's range of the flat parameter buffer (GradBuffer sets it)
    param_data: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    padding: int = 0
    codec: BucketCodec | None = None  # gathers the parameters encoded (gather_with)
    wire: torch.Tensor | None = None  # the encoded bucket, one byte per element

    def full_grad(self) -> torch.Tensor:
        """The full-size gradients; they exist from the first absorbed gradient (always at
        stages 0-1) until a stage-2 reduction frees them."""
        if self.grad is None:
            raise RuntimeError(f"bucket {self.index} holds no gradients at this point")
        return self.grad


class GradBuffer:
    """Flat buffers and buckets for one chunk's parameters of one dtype."""

    def __init__(self, params: list[nn.Parameter], *, stage: int, dp: GroupComm,
                 bucket_numel: int, grad_dtype: torch.dtype, contiguous_gradients: bool,
                 reduce_scatter: bool, overlap: bool, deferred_kind: dict[int, str],
                 apart: frozenset[int] = frozenset()) -> None:
        self.stage = stage
        self.dp = dp
        self.overlap = overlap
        self.reduce_scatter = reduce_scatter
        self.grad_dtype = grad_dtype
        dtype = params[0].dtype
        device = params[0].device
        self.view_mode = stage < 2 and contiguous_gradients and grad_dtype == dtype
        # add each micro-batch's gradient into the (wider) buffer: see the module docstring
        self.accumulate = grad_dtype != dtype
        self.buckets = self._make_buckets(params, bucket_numel, deferred_kind, apart)
        self.numel = sum(b.numel for b in self.buckets)
        self.padding = sum(b.padding for b in self.buckets)
        # stages 1-2 all-gather the parameters and 0-1 reduce the full gradient buffer: in
        # shared memory where the group can (GroupComm.shared_buffer)
        self.param_flat = (dp.shared_buffer(self.numel, dtype, device) if stage in (1, 2)
                           else torch.zeros(self.numel, dtype=dtype, device=device))
        self.slot_of: dict[int, tuple[Bucket, Slot]] = {}
        for b in self.buckets:
            b.param_data = self.param_flat[b.offset:b.offset + b.numel]
            for s in b.slots:
                view = b.param_data[s.start:s.start + s.numel].view_as(s.param)
                view.copy_(s.param.data)
                s.param.data = view
                self.slot_of[id(s.param)] = (b, s)
        self.grad_flat = dp.shared_buffer(self.numel, grad_dtype, device) if stage < 2 else None
        # whether the buckets' collectives run in shared memory (decided once, here)
        self.shared_grads = self.grad_flat is not None and dp.is_shared(self.grad_flat)
        self.shared_params = dp.is_shared(self.param_flat)
        shard_total = sum(b.numel // dp.size for b in self.buckets)
        self.shard_grad_flat = (torch.zeros(shard_total, dtype=grad_dtype, device=device)
                                if stage == 2 else None)
        # stage 2: the parameters whose gradient arrived this step (buckets re-arm after each
        # micro-batch's reduction, so ``pending`` no longer says which ones never did)
        self.got_grad: set[int] = set()
        # stage 2: the buckets whose reduction is in flight, oldest first (at most
        # MAX_IN_FLIGHT: a backward that outpaces the network waits rather than piling up
        # staging buffers, as DeepSpeed's double-buffered reduction does)
        self.in_flight: deque[Bucket] = deque()
        self.gather_hooks: list[Any] = []  # overlap_param_gather's forward pre-hooks
        self.zero_grad()

    def _make_buckets(self, params: list[nn.Parameter], bucket_numel: int,
                      deferred_kind: dict[int, str], apart: frozenset[int]) -> list[Bucket]:
        """Fill buckets in reverse registration order (roughly the order backward produces
        gradients, so early buckets fill first); deferred parameters, and those ``apart``, get
        buckets of their own."""
        n = self.dp.size
        groups: dict[tuple[str | None, bool], list[nn.Parameter]] = {
            (None, False): [], (None, True): [], ("sp", False): [], ("emb", False): []}
        for p in reversed(params):
            kind = deferred_kind.get(id(p))
            groups[kind, kind is None and id(p) in apart].append(p)
        buckets: list[Bucket] = []
        offset = shard_offset = 0
        for (kind, is_apart), plist in groups.items():
            current: list[Slot] = []
            size = 0
            for i, p in enumerate(plist):
                current.append(Slot(p, size, p.numel()))
                size += p.numel()
                if size >= bucket_numel or i == len(plist) - 1:
                    padded = -(-size // n) * n
                    b = Bucket(len(buckets), current, padded, offset, shard_offset, kind,
                               apart=is_apart, padding=padded - size)
                    shard = padded // n
                    b.own_lo, b.own_hi = ((0, padded) if self.stage == 0
                                          else (self.dp.rank * shard, (self.dp.rank + 1) * shard))
                    buckets.append(b)
                    offset += padded
                    shard_offset += shard
                    current, size = [], 0
        return buckets

    # --- per-step gradient life cycle ---------------------------------------------------------

    def zero_grad(self) -> None:
        if self.grad_flat is not None:
            self.grad_flat.zero_()
        if self.shard_grad_flat is not None:
            self.shard_grad_flat.zero_()
        self.got_grad.clear()
        for b in self.buckets:
            self._rearm(b)
            b.handle = None
            b.reductions = 0
            b.grad = (self.grad_flat[b.offset:b.offset + b.numel]
                      if self.grad_flat is not None else None)
            for s in b.slots:
                s.param.grad = (b.full_grad()[s.start:s.start + s.numel].view_as(s.param)
                                if self.view_mode else None)

    @staticmethod
    def _rearm(b: Bucket) -> None:
        """Every parameter of ``b`` awaited again, nothing absorbed, nothing launched."""
        b.pending = {id(s.param) for s in b.slots}
        b.filled = set()
        b.launched = False

    def grad_ready(self, param: nn.Parameter) -> None:
        """A parameter's gradient for this step is complete (called from its hook); at stage 2,
        its gradient of this micro-batch, inside ``no_sync`` too."""
        b, s = self._unreduced_slot(param)
        self._absorb(b, s)
        b.pending.discard(id(param))
        if not b.pending and b.kind is None:
            # A shared-memory all-reduce is deferred to the wait either way: issuing it
            # blocking here would stall backward at every bucket for the slowest rank.
            self._launch(b, async_op=self.overlap or self.shared_grads)
            if self.stage == 2:  # the next micro-batch's gradients start a new staging buffer
                self._rearm(b)

    def _absorb(self, b: Bucket, s: Slot) -> None:
        """Move ``param.grad`` into the bucket unless it already lives there."""
        if self.view_mode:
            view = b.full_grad()[s.start:s.start + s.numel]
            g = s.param.grad
            if g is not None and g.data_ptr() != view.data_ptr():
                # Someone replaced the view (e.g. ``model.zero_grad()``): take the values back.
                view.copy_(g.reshape(-1))
                s.param.grad = view.view_as(s.param)
            return
        if b.grad is None:  # stage 2: a zeroed staging buffer, gradients added in
            b.grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.param_flat.device)
        g = s.param.grad
        if g is not None:
            self.got_grad.add(id(s.param))
        if g is not None and (self.accumulate or self.stage == 2):
            # added in grad_dtype (a bf16 gradient is widened first), pre-divided like below;
            # at stage 2 a bucket that did not fill in one micro-batch adds the next one's
            b.grad[s.start:s.start + s.numel].add_(g.reshape(-1), alpha=1.0 / self.dp.size)
            b.filled.add(s.start)
        elif g is not None:
            # The 1/dp of the average is applied in this copy rather than in a separate pass.
            view = b.grad[s.start:s.start + s.numel]
            torch.mul(g.reshape(-1), 1.0 / self.dp.size, out=view)
            b.filled.add(s.start)
        s.param.grad = None

    def _launch(self, b: Bucket, async_op: bool) -> None:
        """Average the bucket over data-parallel ranks: summed, then divided (the all-reduce
        does the division, before its sum or after it); slots copied in were divided then."""
        b.launched = True
        b.reductions += 1
        if self.stage == 2:
            if b.handle is not None:  # the previous micro-batch's reduction of this bucket
                b.handle.wait()
            # a finished reduction frees its staging buffer now, and at most MAX_IN_FLIGHT
            # stay in flight
            while self.in_flight and (len(self.in_flight) >= MAX_IN_FLIGHT
                                      or self.in_flight[0].handle is None
                                      or self.in_flight[0].handle.ready()):
                done = self.in_flight.popleft()
                if done.handle is not None:
                    done.handle.wait()
        average = False  # whether the sum still has to be divided by dp
        if b.grad is None:
            b.grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.param_flat.device)
        elif self.view_mode:
            average = True
        else:  # copy mode: absorbed slots are already divided
            self._zero_unfilled(b)
        if self.stage == 0 or (self.stage == 1 and not self.reduce_scatter):
            b.handle = self.dp.all_reduce(b.grad, async_op=async_op, average=average)
        elif self.stage == 1 and self.shared_grads:  # the sum lands in this rank's shard
            b.handle = self.dp.reduce_scatter_in_place(b.grad, async_op=async_op,
                                                       average=average)
        elif self.stage == 1:
            if average and self.dp.size > 1:
                b.grad.div_(self.dp.size)  # pre-divided, then summed
            out = torch.empty(b.own_hi - b.own_lo, dtype=b.grad.dtype, device=b.grad.device)
            h = self.dp.reduce_scatter(out, b.grad, async_op=async_op)
            b.handle = Handle(h, lambda: b.full_grad()[b.own_lo:b.own_hi].copy_(out))
        else:  # stage 2: this micro-batch's sum is added into the shard
            shard = self._shard_grads()[b.shard_offset:b.shard_offset + b.own_hi - b.own_lo]
            full = b.grad
            b.grad = None  # the staging buffer lives on in the collective until it finishes
            if self.reduce_scatter:
                out = torch.empty_like(shard)
                h = self.dp.reduce_scatter(out, full, async_op=async_op)
                b.handle = Handle(h, lambda: shard.add_(out))
            else:
                h = self.dp.all_reduce(full, async_op=async_op)
                b.handle = Handle(h, lambda: shard.add_(full[b.own_lo:b.own_hi]))
            if async_op:
                self.in_flight.append(b)
        if not async_op:
            b.handle.wait()

    def _zero_unfilled(self, b: Bucket) -> None:
        """Zero what no gradient was copied into (unused parameters, padding)."""
        grad = b.full_grad()
        for s in b.slots:
            if s.start not in b.filled:
                grad[s.start:s.start + s.numel].zero_()
                b.filled.add(s.start)
        grad[b.numel - b.padding:].zero_()

    def flush(self) -> None:
        """Launch every normal bucket still waiting (unused parameters, or a backward that ran
        entirely inside ``no_sync``); gradients sitting in ``param.grad`` are absorbed first.
        At stage 2 the buckets holding gradients not yet reduced, and (with zeros) those not
        reduced at all this step: every bucket is reduced at least once per step."""
        for b in self.buckets:
            if b.launched or b.kind is not None:
                continue
            for s in b.slots:
                if id(s.param) in b.pending and (self.stage < 2 or s.param.grad is not None):
                    self._absorb(b, s)
            if self.stage == 2 and b.grad is None and b.reductions:
                continue
            b.pending.clear()
            self._launch(b, async_op=self.overlap or self.shared_grads)

    def wait(self) -> None:
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
        self.in_flight.clear()

    def deferred_grads(self, kind: str) -> list[torch.Tensor]:
        """Full gradients of the deferred buckets of ``kind``, for the tp / embedding sum."""
        return [b.full_grad() for b in self.buckets if b.kind == kind]

    def grad_accumulated(self, param: nn.Parameter) -> None:
        """Inside ``no_sync``: the gradient stays where autograd accumulates it, or in
        accumulate mode is added into the wider buffer now (and ``param.grad`` freed). At
        stage 2 a normal bucket's gradient is reduced as outside (see the module docstring)."""
        if self.stage == 2 and self.slot_of[id(param)][0].kind is None:
            self.grad_ready(param)
        elif self.accumulate:
            self._absorb(*self._unreduced_slot(param))

    def _unreduced_slot(self, param: nn.Parameter) -> tuple[Bucket, Slot]:
        b, s = self.slot_of[id(param)]
        if b.launched:
            raise RuntimeError(
                "a gradient arrived after its bucket was already reduced this step; run the "
                "backward of every micro-batch but the last inside engine.no_sync() and call "
                "engine.zero_grad() before the next step")
        return b, s

    def params(self) -> list[nn.Parameter]:
        return [s.param for b in self.buckets for s in b.slots]

    def absorb_deferred(self) -> None:
        for b in self.buckets:
            if b.kind is not None:
                for s in b.slots:
                    if id(s.param) in b.pending:
                        self._absorb(b, s)
                b.pending.clear()
                if b.grad is None:
                    b.grad = torch.zeros(b.numel, dtype=self.grad_dtype,
                                         device=self.param_flat.device)
                elif not self.view_mode:
                    self._zero_unfilled(b)

    def reduce_deferred(self) -> None:
        for b in self.buckets:
            if b.kind is not None and not b.launched:
                self._launch(b, async_op=False)

    def unused_params(self) -> list[nn.Parameter]:
        if self.stage == 2:
            return [s.param for b in self.buckets for s in b.slots
                    if id(s.param) not in self.got_grad and s.param.grad is None]
        return [s.param for b in self.buckets for s in b.slots
                if id(s.param) in b.pending and s.param.grad is None and not self.view_mode
                and s.start not in b.filled]

    # --- views used by the optimizer ----------------------------------------------------------

    def param_view(self, b: Bucket, lo: int, hi: int) -> torch.Tensor:
        return self.param_flat[b.offset + lo:b.offset + hi]

    def grad_view(self, b: Bucket, lo: int, hi: int) -> torch.Tensor:
        if self.stage == 2:
            base = b.shard_offset - b.own_lo
            return self._shard_grads()[base + lo:base + hi]
        assert self.grad_flat is not None  # stages 0-1 keep a full gradient buffer
        return self.grad_flat[b.offset + lo:b.offset + hi]

    def _shard_grads(self) -> torch.Tensor:
        assert self.shard_grad_flat is not None  # stage 2 keeps only the reduced shards
        return self.shard_grad_flat

    def after_step(self, chunk: int | None, use_broadcast: bool) -> None:
        """Refresh every rank's full parameters from the owners' updated shards."""
        self.start_param_gather(chunk, use_broadcast)
        self.wait_param_gather()

    def start_param_gather(self, chunk: int | None, use_broadcast: bool) -> None:
        """Issue every bucket's all-gather (all in flight at once) without waiting: each
        bucket's handle waits in :meth:`wait_param_gather`, which the forward pre-hooks of
        :func:`megazero.zero.param_gather.register_param_gather_hooks` call
        (``overlap_param_gather``)."""
        self.wait_param_gather()  # a gather still in flight must not land after this one
        if self.stage == 0:
            return
        for b in self.buckets:
            if b.codec is not None:  # at dp 1 too: every layout computes with the decoded copy
                b.gather = self._gather_encoded(b, chunk, use_broadcast)
                continue
            if self.dp.size == 1:
                continue
            if self.shared_params:  # straight from the owners' buffers
                b.gather = self.dp.all_gather_in_place(b.param_data, async_op=True)
                continue
            shard = b.param_data[b.own_lo:b.own_hi]
            if not self.dp.inplace_all_gather:
                shard = shard.clone()
            b.gather = self.dp.all_gather(b.param_data, shard, async_op=True, chunk=chunk,
                                          use_broadcast=use_broadcast)

    def gather_with(self, codec_for: Callable[[list[nn.Parameter]], BucketCodec | None]
                    ) -> int:
        """Gather the buckets of ``apart`` parameters through ``codec_for(their parameters)``
        (None: as they are) from the next step on; returns how many parameters are. Collective
        over the data-parallel group (the encoded buckets' buffer, in shared memory where the
        parameters' is)."""
        count = 0
        for b in self.buckets:
            if b.apart and self.stage in (1, 2):
                b.codec = codec_for([s.param for s in b.slots])
                count += len(b.slots) if b.codec is not None else 0
        numel = sum(b.numel for b in self.buckets if b.codec is not None)
        wire = (self.dp.shared_buffer(numel, torch.uint8, self.param_flat.device)
                if self.shared_params else
                torch.zeros(numel, dtype=torch.uint8, device=self.param_flat.device))
        offset = 0
        for b in self.buckets:
            if b.codec is not None:
                b.wire = wire[offset:offset + b.numel]
                offset += b.numel
        return count

    def _gather_encoded(self, b: Bucket, chunk: int | None, use_broadcast: bool) -> Handle:
        assert b.codec is not None and b.wire is not None
        ranges = [(s.start, s.numel) for s in b.slots]
        return gather_encoded(self.dp, b.codec, b.param_data, b.wire, ranges, b.own_lo, b.own_hi,
                              self.shared_params, chunk, use_broadcast)

    def wait_param_gather(self, buckets: tuple[int, ...] | None = None) -> None:
        """Wait for the all-gather of these buckets (default: all) if one is in flight."""
        for b in self.buckets if buckets is None else (self.buckets[i] for i in buckets):
            if b.gather is not None:
                h, b.gather = b.gather, None
                h.wait()

    def held_grads(self) -> list[torch.Tensor]:
        out = [self.grad_flat, self.shard_grad_flat]
        out += [b.grad for b in self.buckets if b.grad is not None]
        if not self.view_mode:
            out += [s.param.grad for b in self.buckets for s in b.slots]
        return [t for t in out if t is not None]

    def pieces(self) -> list[Piece]:
        """This rank's owned ranges of each parameter, for the master weights."""
        out = []
        for b in self.buckets:
            for s in b.slots:
                lo, hi = max(s.start, b.own_lo), min(s.start + s.numel, b.own_hi)
                if lo < hi:
                    out.append(Piece(s.param, self.param_view(b, lo, hi),
                                     self.grad_view(b, lo, hi), offset=lo - s.start))
        return out

    def held_params(self) -> dict[str, list[torch.Tensor]]:
        return {"device": [self.param_flat]}

    def param_shapes(self) -> dict[int, torch.Size]:
        return {id(p): p.shape for p in self.params()}

    def gather_all(self) -> None:
        """Every rank holds full parameters at stages 0-2: nothing to gather."""

    def release_all(self, write_back: bool = False) -> None:
        """Values written into the parameters stay (they are the flat buffer)."""

    def gathered_state(self) -> dict[int, torch.Tensor]:
        return {id(p): p.detach().clone() for p in self.params()}
