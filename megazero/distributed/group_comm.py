"""Data-parallel collectives with byte accounting and backend fallbacks.

Every collective the ZeRO engine issues goes through :class:`GroupComm`, which records two
numbers per call:

* **logical bytes**: what a ring implementation moves per rank (the ZeRO paper's model):
  all-reduce ``2(N-1)/N * B``, reduce-scatter and all-gather ``(N-1)/N * B`` with ``B`` the full
  (unsharded) tensor size. These are the numbers to compare with the ZeRO formulas.
* **physical bytes**: what the operation actually used moves under the same ring model. They
  differ from the logical bytes only when a fallback replaced the collective: a reduce-scatter
  done as ``all_reduce`` + slice moves twice the bytes; done as ``all_to_all`` it moves the same.

Which implementation a backend gets is decided in :mod:`megazero.distributed.collectives` (by
backend name and torch version); ``reduce_scatter_impl`` forces one for testing and benchmarks.

Buffers made by :meth:`GroupComm.shared_buffer` live in shared memory when every rank of a gloo
group runs on this host (:mod:`megazero.distributed.shm_collectives`); an all-reduce,
reduce-scatter or all-gather of a piece of one goes through it: issuing one only records it, and
the first wait runs every recorded one in one pass between two barriers. ``shared_memory``
(``auto``, ``backend``, ``shared_memory``) forces a choice.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megazero.distributed import collectives
from megazero.distributed.shm_collectives import (
    SHARED_MEMORY_IMPLS,
    SharedOp,
    SharedSlots,
    merge_ops,
    shared_host_group,
)
from megazero.errors import ConfigError
from megazero.observability import comms_logging


@dataclass
class CommLog:
    """Bytes moved per (group, op) since the last :meth:`reset` (one optimizer step)."""

    logical: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    physical: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def reset(self) -> None:
        self.logical.clear()
        self.physical.clear()
        self.calls.clear()

    def record(self, group: str, op: str, logical: float, physical_op: str,
               physical: float) -> None:
        self.logical[(group, op)] += logical
        self.physical[(group, physical_op)] += physical
        self.calls[(group, op)] += 1

    def report(self) -> dict[str, Any]:
        return {
            "logical_bytes": {f"{g}/{op}": v for (g, op), v in sorted(self.logical.items())},
            "physical_bytes": {f"{g}/{op}": v for (g, op), v in sorted(self.physical.items())},
            "calls": {f"{g}/{op}": v for (g, op), v in sorted(self.calls.items())},
            "note": "logical = ring-collective bytes per rank (ZeRO formulas); physical = bytes "
                    "the operation actually issued would move under the same ring model "
                    "(differs only where a fallback replaced a collective)",
        }


class Handle:
    """An in-flight collective plus the local work to finish it (copy, sum, free).

    ``label`` and ``timers`` (a :class:`megazero.observability.monitor.Timers`): the wait is
    charged to the region ``"<label> wait"``."""

    def __init__(self, work: Any = None, finish: Callable[[], object] | None = None,
                 label: str | None = None, timers: Any = None) -> None:
        self._work = work
        self._finish = finish
        self._label = label
        self._timers = timers
        self.done = False

    def ready(self) -> bool:
        """Whether :meth:`wait` would not block (the collective already completed)."""
        if self.done or self._work is None:
            return True
        probe = getattr(self._work, "ready", None) or getattr(self._work, "is_completed", None)
        return bool(probe()) if probe is not None else False

    def wait(self) -> None:
        if self.done:
            return
        timed = self._timers is not None and self._label is not None
        if timed:
            self._timers.start(f"{self._label} wait")
        try:
            if self._work is not None:
                self._work.wait()
            if self._finish is not None:
                self._finish()
        finally:
            if timed:
                self._timers.stop(f"{self._label} wait")
        self.done = True


class GroupComm:
    """Collectives over one process group (``group=None`` with ``size == 1`` is a no-op world).

    ``reduce_scatter_impl`` is ``"auto"`` (``all_to_all`` on gloo, else ``native``),
    ``"native"``, ``"all_to_all"`` or ``"all_reduce"``; a backend without the one asked for gets
    the next (:func:`megazero.distributed.collectives.reduce_scatter_impl`).
    """

    def __init__(self, group: Any, name: str, log: CommLog,
                 reduce_scatter_impl: str = "auto", shared_memory: str = "auto") -> None:
        self.group = group
        self.name = name
        self.log = log
        initialized = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if initialized and group is not None else 1
        self.rank = dist.get_rank(group) if initialized and group is not None else 0
        backend = collectives.backend_of(group)
        self.rs_impl = collectives.reduce_scatter_impl(reduce_scatter_impl, backend)
        self.inplace_all_gather = collectives.all_gather_accepts_view(backend)
        # a megazero.observability.monitor.Timers when wall_clock_breakdown is on
        self.timers: Any = None
        if shared_memory not in SHARED_MEMORY_IMPLS:
            raise ConfigError(f"shared_memory {shared_memory!r}: expected one of "
                              f"{', '.join(SHARED_MEMORY_IMPLS)}")
        self.shared_memory = shared_memory
        self._backend = backend
        self._shared_host: tuple[bool, str] | None = None  # decided on the first shared_buffer
        self._segments: list[SharedSlots] = []
        self._pending: dict[int, list[SharedOp]] = {}  # segment index -> recorded collectives
        self._flag = torch.zeros(1)  # the barriers' 1-element all-reduce
        self.flushes = 0

    def shared_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer whose pieces this group's collectives work on in place: this
        rank's buffer in shared memory when the group can use one (see the module docstring),
        else an ordinary tensor. Collective over the group (every rank makes the same buffers in
        the same order)."""
        if (self.size == 1 or numel == 0 or self.shared_memory == "backend"
                or device.type != "cpu"):
            return torch.zeros(numel, dtype=dtype, device=device)
        if self._shared_host is None:
            self._shared_host = shared_host_group(self.group, self._backend)
        ok, reason = self._shared_host
        seg = None
        if ok:
            seg, reason = SharedSlots.create(self.group, numel, dtype)
        if seg is None:
            if self.shared_memory == "shared_memory":
                raise ConfigError(f"shared_memory 'shared_memory' for the {self.name} group: "
                                  f"{reason}; use 'auto' to fall back to the backend")
            if ok and self.rank == 0:  # the group qualifies, the buffer did not fit
                warnings.warn(f"{self.name} collectives use {self._backend}, not shared "
                              f"memory: {reason}", stacklevel=2)
            return torch.zeros(numel, dtype=dtype, device=device)
        self._segments.append(seg)
        return seg.local

    def _label(self, op: str) -> str:
        return f"comm {self.name}/{op}"

    @contextmanager
    def _issue(self, op: str, async_op: bool) -> Iterator[None]:
        """Time the call that issues a collective: the whole collective when blocking, the
        launch when asynchronous (its wait is timed by the returned :class:`Handle`)."""
        t = self.timers
        if t is None or not t.enabled:
            yield
            return
        name = self._label(op) + (" launch" if async_op else "")
        t.start(name)
        try:
            yield
        finally:
            t.stop(name)

    def _handle(self, work: Any, op: str, finish: Callable[[], object] | None = None) -> Handle:
        """The :class:`Handle` of an asynchronous collective; with timers on, its in-flight time
        (launch to completion: CUDA events on NCCL, see :mod:`megazero.observability.timers`) is
        recorded as overlapped time."""
        t = self.timers
        if t is None or not t.enabled:
            return Handle(work, finish)
        label = self._label(op)
        t.time_in_flight(f"{label} in flight", work)
        return Handle(work, finish, label, t)

    def _frac(self) -> float:
        return (self.size - 1) / self.size

    def all_reduce(self, t: torch.Tensor, async_op: bool = False, op: Any = None,
                   what: str = "all_reduce", average: bool = False) -> Handle:
        """Sum ``t`` over the group (``op``: another reduction), then divide by the group's
        size when ``average``. A piece of a :meth:`shared_buffer` in shared memory is only
        recorded when ``async_op``: the first wait runs every recorded collective."""
        if self.size == 1:
            return Handle()
        b = t.numel() * t.element_size()
        self.log.record(self.name, what, 2 * self._frac() * b, what, 2 * self._frac() * b)
        shared = self._shared_range(t) if op is None else None
        with self._issue(what, async_op):
            if shared is not None:
                work: Any = self._record(SharedOp("all_reduce", *shared[1:], average),
                                         shared[0], async_op)
            else:
                if average:
                    t.div_(self.size)  # pre-divided: no pass over the summed tensor after
                work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group,
                                       async_op=async_op)
        return self._handle(work, what) if async_op else _done()

    def is_shared(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a piece of a shared-memory :meth:`shared_buffer`: its collectives
        are recorded when issued and run at the first wait (issuing them asynchronously
        overlaps nothing)."""
        return self._shared_range(t) is not None

    def reduce_scatter_in_place(self, t: torch.Tensor, async_op: bool = False,
                                average: bool = False) -> Handle:
        """Shard ``r`` of ``t`` (a piece of a shared-memory :meth:`shared_buffer`, numel a
        multiple of the group's size) becomes the sum of every rank's shard ``r`` (divided by
        the size when ``average``) on rank ``r``; the other shards keep this rank's values."""
        shared = self._require_shared(t, "reduce_scatter_in_place")
        logical = self._frac() * t.numel() * t.element_size()
        self.log.record(self.name, "reduce_scatter", logical, "reduce_scatter", logical)
        with self._issue("reduce_scatter", async_op):
            work = self._record(SharedOp("reduce_scatter", *shared[1:], average), shared[0],
                                async_op)
        return self._handle(work, "reduce_scatter") if async_op else _done()

    def all_gather_in_place(self, t: torch.Tensor, async_op: bool = False) -> Handle:
        """Every rank's shard ``r`` of ``t`` (a piece of a shared-memory
        :meth:`shared_buffer`, numel a multiple of the group's size) becomes rank ``r``'s."""
        shared = self._require_shared(t, "all_gather_in_place")
        logical = self._frac() * t.numel() * t.element_size()
        self.log.record(self.name, "all_gather", logical, "all_gather", logical)
        with self._issue("all_gather", async_op):
            work = self._record(SharedOp("all_gather", *shared[1:]), shared[0], async_op)
        return self._handle(work, "all_gather") if async_op else _done()

    def _require_shared(self, t: torch.Tensor, what: str) -> tuple[int, int, int]:
        shared = self._shared_range(t)
        if shared is None or t.numel() % self.size:
            raise ValueError(f"{what}: the tensor must be a piece of this group's shared "
                             f"buffer with a multiple of {self.size} elements")
        return shared

    def _record(self, op: SharedOp, segment: int, async_op: bool) -> _SharedPending:
        self._pending.setdefault(segment, []).append(op)
        work = _SharedPending(self)
        if not async_op:
            work.wait()
        return work

    def _shared_range(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        for i, seg in enumerate(self._segments):
            where = seg.owns(t)
            if where is not None:
                return i, where[0], where[1]
        return None

    def flush_shared(self) -> None:
        """Run every recorded shared-memory collective, between two barriers (in order of
        buffer, then offset: the same on every rank)."""
        pending, self._pending = self._pending, {}
        self.flushes += 1
        if not pending:
            return
        dist.all_reduce(self._flag, group=self.group)
        logged = comms_logging.installed_logger() is not None
        for i in sorted(pending):
            segment = self._segments[i]
            if not logged:
                segment.apply(merge_ops(pending[i]))
                continue
            for op in merge_ops(pending[i]):  # one at a time, each timed
                start = time.perf_counter()
                segment.apply([op])
                comms_logging.record_shared_memory(
                    op.kind, (op.hi - op.lo) * segment.local.element_size(),
                    (time.perf_counter() - start) * 1e3, self.size)
        dist.all_reduce(self._flag, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       async_op: bool = False) -> Handle:
        """``out`` (numel B/N) receives this rank's summed shard of ``inp`` (numel B)."""
        if self.size == 1:
            out.copy_(inp)
            return _done()
        logical = self._frac() * inp.numel() * inp.element_size()
        op = "reduce_scatter"
        with self._issue(op, async_op):
            issued = collectives.reduce_scatter(out, inp, self.group, self.rs_impl,
                                                async_op=async_op)
        self.log.record(self.name, op, logical, issued.op, logical * issued.wire_factor)
        return self._handle(issued.work, op, issued.finish) if async_op else _done()

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   chunk: int | None = None, use_broadcast: bool = False) -> Handle:
        """Fill ``out`` (numel B, rank-major) from every rank's ``shard`` (numel B/N).

        ``chunk`` bounds the elements per rank per collective (``allgather_bucket_size / N``);
        ``use_broadcast`` has every rank broadcast its partition instead
        (``allgather_partitions: false``); both move the same logical bytes.
        """
        n = shard.numel()
        if self.size == 1:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return _done()
        logical = self._frac() * out.numel() * out.element_size()
        views = out.view(self.size, n)
        step = n if not chunk or chunk >= n else max(1, chunk)
        works = []
        op = "broadcast" if use_broadcast else "all_gather"
        with self._issue("all_gather", True):
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                if use_broadcast:
                    for r in range(self.size):
                        piece = views[r, lo:hi]
                        if r == self.rank:
                            piece.copy_(shard[lo:hi])
                        src = dist.get_global_rank(self.group, r)
                        works.append(dist.broadcast(piece, src, group=self.group,
                                                    async_op=True))
                elif step == n:
                    works.append(collectives.all_gather(out, shard, self.group, async_op=True))
                else:
                    outs = [views[r, lo:hi] for r in range(self.size)]
                    works.append(dist.all_gather(outs, shard[lo:hi].clone(), group=self.group,
                                                 async_op=True))
        self.log.record(self.name, "all_gather", logical, op, logical)
        h = self._handle(_Many(works), "all_gather")
        if not async_op:
            h.wait()
        return h


class _SharedPending:
    """The work of a shared-memory all-reduce: done once its group has flushed."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.flushes = comm.flushes

    def ready(self) -> bool:
        return self.comm.flushes > self.flushes

    def wait(self) -> None:
        if not self.ready():
            self.comm.flush_shared()


class _Many:
    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()

    def get_future(self) -> Any:
        return torch.futures.collect_all([w.get_future() for w in self.works if w is not None])


def _done() -> Handle:
    h = Handle()
    h.done = True
    return h
