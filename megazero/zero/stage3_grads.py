"""ZeRO stage 3, gradient side: once all of a unit's gradients arrived they are copied into its
slot of a gradient bucket and the unit's gathered parameters are released; once every unit of a
bucket is in, the bucket is reduce-scattered over the data-parallel group in one collective into
the units' persistent gradient shards.

A bucket is a run of consecutive units (module order, which the backward walks in reverse) of
at most ``reduce_bucket_size`` padded elements; a larger unit is a bucket of its own. Its input
is rank-major: row ``r`` holds every unit's chunk ``r`` side by side, so row ``r`` is what rank
``r`` receives summed, and the units' gradient shards are consecutive views of one flat buffer.
Small units (LayerNorms, biases) thus share a collective instead of paying one each.

Gradients are partitioned across the accumulation window too, as DeepSpeed's ZeRO-3 does: a
bucket is reduce-scattered as soon as every unit of it has this micro-batch's gradients, inside
``no_sync`` as well, and the result is added into the units' shards. The bucket's input is
zeroed when allocated and gradients are added into it (in the gradient dtype: fp32 for bf16
parameters by default, Megatron's ``main_grad``), so a bucket that does not complete in one
micro-batch (an unused parameter) takes the next one's gradients as well, until it completes
or the step's flush reduces it. No full-size gradient outlives a micro-batch's backward; the
price is one reduction per micro-batch. At most one bucket's reduction is in flight.

A bucket holds units of one group only: MoE expert units partitioned over the
expert-data-parallel group (:mod:`megazero.zero.stage3`) are reduce-scattered over it. Their
gradients are multiplied by ``1 / dp`` like the dense ones, not ``1 / edp``: summed over ``edp``
that is the stage 0-2 experts' ``edp / dp`` factor (:mod:`megazero.moe.grads`), the gradient of
the mean loss the one-process run minimises.

Units holding sequence-parallel or tied-embedding parameters (``Unit.kind`` set) wait, each in
a bucket of its own: the engine first sums their ``deferred_grads`` over the tensor-parallel or
embedding group, then ``reduce_deferred`` scatters them. :class:`Stage3Grads` is the base of
:class:`megazero.zero.stage3.Stage3Params`, which owns the units and their gather/release.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from torch import nn

from megazero.distributed.group_comm import GroupComm, Handle
from megazero.zero.units import GradBucket, Unit


def plan_grad_buckets(sizes: list[int], alone: list[bool], bucket_numel: int,
                      groups: list[int] | None = None) -> list[list[int]]:
    """Indices of consecutive units, at most ``bucket_numel`` padded elements (``sizes``) per
    bucket; a larger unit, or one marked ``alone`` (a deferred kind), is a bucket of its own.
    ``groups``: a key per unit (its process group); a bucket never spans two keys.
    The planner replays the same rule."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    keys = groups if groups is not None else [0] * len(sizes)
    for i, (n, solo) in enumerate(zip(sizes, alone)):
        if cur and (solo or size + n > bucket_numel or keys[i] != keys[cur[-1]]):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
        if solo:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def segments(u: Unit, start: int, numel: int) -> Iterator[tuple[int, int, int, int]]:
    """Elements ``[start, start+numel)`` of the unit's flat (padded) order as pieces of the
    bucket's rows: ``(row, column_lo, column_hi, offset into the range)``."""
    k = u.shard_size
    lo, hi = start, start + numel
    while lo < hi:
        row, c = divmod(lo, k)
        n = min(hi - lo, k - c)
        yield row, u.column + c, u.column + c + n, lo - start
        lo += n


class Stage3Grads:
    """The gradient half of :class:`megazero.zero.stage3.Stage3Params`."""

    units: list[Unit]
    buckets: list[GradBucket]
    unit_of_param: dict[int, Unit]
    dp: GroupComm
    grad_dtype: torch.dtype
    dtype: torch.dtype
    device: torch.device
    overlap: bool

    def _release(self, u: Unit) -> None:
        raise NotImplementedError  # the parameter side (Stage3Params) frees the gathered unit

    in_flight: deque[GradBucket]  # normal buckets whose reduction is in flight (at most one)
    got_grad: set[int]  # the parameters whose gradient arrived this step

    def _build_grad_buckets(self, bucket_numel: int) -> None:
        """Group the units into buckets and point their gradient shards into them (before the
        optimizer takes views of the shards)."""
        comm = [getattr(u, "comm", self.dp) for u in self.units]
        plan = plan_grad_buckets([u.padded for u in self.units],
                                 [u.kind is not None for u in self.units], bucket_numel,
                                 [int(c is not self.dp) for c in comm])
        self.buckets = [GradBucket([self.units[i] for i in idx], comm[idx[0]].size,
                                   self.grad_dtype, self.device, comm[idx[0]]) for idx in plan]
        self.in_flight, self.got_grad = deque(), set()

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.shard.zero_()
            b.free()
            b.handle = None
            b.absorbed = 0
            b.launched = False
            b.reductions = 0
        self.in_flight.clear()
        self.got_grad.clear()
        for u in self.units:
            u.reduced = False
            u.counted = False
            u.filled = set()
            u.pending = {id(p) for p in u.params}
            for p in u.params:
                p.grad = None

    def _accumulating(self) -> bool:
        """Whether gradients are added into a wider buffer at every backward (module
        docstring)."""
        return self.grad_dtype != self.dtype

    def _slot(self, u: Unit) -> torch.Tensor:
        """The bucket's ``dp x width`` input, where the unit owns columns ``[column, column +
        shard_size)``; :func:`segments` addresses them. Zeroed when allocated (gradients are
        added in), but for a deferred unit outside accumulate mode (copied in once)."""
        return u.bucket.rows(self.grad_dtype, self.device,
                             zeroed=self._accumulating() or u.kind is None)

    def _absorb(self, u: Unit) -> None:
        """Add (a deferred unit outside accumulate mode: copy) the unit's gradients into its
        bucket slot, applying the 1/dp of the average in the same pass (dp, also for expert
        units reduced over edp: module docstring); a deferred unit's slots never filled are
        zeroed before the reduction."""
        rows = self._slot(u)
        add = self._accumulating() or u.kind is None
        for i, (p, s, shape) in enumerate(zip(u.params, u.starts, u.shapes)):
            if p.grad is not None:
                self.got_grad.add(id(p))
                g = p.grad.reshape(-1)
                for r, c0, c1, a in segments(u, s, shape.numel()):
                    if add:  # widened, then scaled and summed in grad_dtype
                        rows[r, c0:c1].add_(g[a:a + c1 - c0], alpha=1.0 / self.dp.size)
                    else:
                        torch.mul(g[a:a + c1 - c0], 1.0 / self.dp.size, out=rows[r, c0:c1])
                u.filled.add(i)
                p.grad = None

    def _zero_unfilled(self, u: Unit) -> None:
        rows = self._slot(u)
        for i, (s, shape) in enumerate(zip(u.starts, u.shapes)):
            if i not in u.filled:
                for r, c0, c1, _ in segments(u, s, shape.numel()):
                    rows[r, c0:c1].zero_()
                u.filled.add(i)
        for r, c0, c1, _ in segments(u, u.numel, u.padding):
            rows[r, c0:c1].zero_()

    def grad_accumulated(self, param: nn.Parameter) -> None:
        """Inside ``no_sync``: a normal unit's gradient is reduced as outside (module
        docstring); a deferred unit's stays (or in accumulate mode is added into its bucket),
        and its parameters are released once all arrived."""
        u = self.unit_of_param[id(param)]
        if u.kind is None:
            self.grad_ready(param)
            return
        u.pending.discard(id(param))
        if not u.pending:
            u.pending = {id(p) for p in u.params}
            if self._accumulating():
                self._absorb(u)
            self._release(u)

    def grad_ready(self, param: nn.Parameter) -> None:
        u = self.unit_of_param[id(param)]
        if u.reduced:
            raise RuntimeError("a gradient arrived after its unit was already reduced this "
                               "step; run earlier micro-batches inside engine.no_sync()")
        u.pending.discard(id(param))
        if u.pending:
            return
        self._absorb(u)
        self._release(u)
        if u.kind is None:
            u.pending = {id(p) for p in u.params}  # the next micro-batch's gradients
            self._commit(u)

    def _commit(self, u: Unit) -> None:
        """The unit's gradients of this micro-batch are in its bucket: count it (once per
        round of the bucket), and reduce the bucket once every unit is in."""
        b = u.bucket
        if not u.counted:
            u.counted = True
            b.absorbed += 1
        if b.absorbed == len(b.units):
            self._launch(b, async_op=self.overlap)

    def _launch(self, b: GradBucket, async_op: bool) -> None:
        """Reduce-scatter the bucket's input and add the result into the units' shards; a
        normal bucket then starts its next round (its units counted again from none)."""
        b.launched = True
        b.reductions += 1
        if b.handle is not None:  # this bucket's previous round
            b.handle.wait()
        while self.in_flight:  # at most one in flight: wait for it, which frees its input
            done = self.in_flight.popleft()
            if done.handle is not None:
                done.handle.wait()
        if b.full is None:  # a bucket no gradient reached this step: its zeros
            b.rows(self.grad_dtype, self.device, zeroed=True)
        full: torch.Tensor = b.full  # type: ignore[assignment]  # set just above
        b.full = None
        out = torch.empty_like(b.shard)
        work = (b.comm or self.dp).reduce_scatter(out, full, async_op=async_op)
        shard = b.shard
        b.handle = Handle(work, lambda: shard.add_(out))
        if b.units[0].kind is None:
            b.absorbed = 0
            for u in b.units:
                u.counted = False
                u.filled = set()
        if async_op:
            self.in_flight.append(b)
        else:
            b.handle.wait()

    def flush(self) -> None:
        """After the backward: units whose gradients did not all arrive in the last round
        (parameters unused this step) add what they have, their parameters are released, and
        every bucket holding gradients not yet reduced is reduced, and so is (with zeros) one
        not reduced at all this step: every bucket is reduced at least once per step on every
        rank, whichever parameters were used."""
        for u in self.units:
            if u.kind is not None:
                continue
            if any(p.grad is not None for p in u.params):  # the last round's partial unit
                self._absorb(u)
            self._release(u)
            u.pending = {id(p) for p in u.params}
        for b in self.buckets:
            if b.units[0].kind is None and (b.full is not None or not b.reductions):
                self._launch(b, async_op=self.overlap)

    def wait(self) -> None:
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
        self.in_flight.clear()

    def absorb_deferred(self) -> None:
        for u in self.units:
            if u.kind is not None and not u.reduced:
                self._absorb(u)
                self._zero_unfilled(u)
                self._release(u)

    def deferred_grads(self, kind: str) -> list[torch.Tensor]:
        """The gradient slices of this kind's parameters (not the whole unit: its other
        parameters' gradients must not be summed). A deferred unit is alone in its bucket, so
        the bucket's input is the unit's flat order."""
        return [self._slot(u).view(-1)[s:s + n] for u in self.units if not u.reduced
                for s, n, k in u.deferred if k == kind]

    def reduce_deferred(self) -> None:
        for u in self.units:
            if u.kind is not None and not u.reduced:
                u.reduced = True
                self._launch(u.bucket, async_op=False)

    def unused_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params
                if id(p) not in self.got_grad and p.grad is None]

    def held_grads(self) -> list[torch.Tensor]:
        out = [b.shard for b in self.buckets]
        out += [b.full for b in self.buckets if b.full is not None]
        out += [p.grad for u in self.units for p in u.params if p.grad is not None]
        return out
