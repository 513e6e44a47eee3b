"""Data-parallel collectives with byte accounting and backend fallbacks.

Every collective the ZeRO engine issues goes through :class:`GroupComm`, which records two
numbers per call:

* **logical bytes**: what a ring implementation moves per rank (the ZeRO paper's model):
  all-reduce ``2(N-1)/N * B``, reduce-scatter and all-gather ``(N-1)/N * B`` with ``B`` the full
  (unsharded) tensor size. These are the numbers to compare with the ZeRO formulas.
* **physical bytes**: what the operation actually used moves under the same ring model. They
  differ from the logical bytes only when a fallback replaced the collective: a reduce-scatter
  done as ``all_reduce`` + slice moves twice the bytes; done as ``all_to_all`` it moves the same.

gloo in recent torch has native ``reduce_scatter_single``; older builds and some backends do not,
so the fallbacks are kept (and can be forced for testing).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megazero.compat import all_gather_into_tensor


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

    def total_logical(self, group: str | None = None) -> float:
        return sum(v for (g, _), v in self.logical.items() if group is None or g == group)

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
    """An in-flight collective plus the local work to finish it (copy, sum, free)."""

    def __init__(self, work: Any = None, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        self.done = True


class GroupComm:
    """Collectives over one process group (``group=None`` with ``size == 1`` is a no-op world).

    ``reduce_scatter_impl`` is ``"native"``, ``"all_to_all"`` or ``"all_reduce"``; ``native``
    falls back to ``all_to_all`` automatically when the backend lacks it.
    """

    def __init__(self, group: Any, name: str, log: CommLog,
                 reduce_scatter_impl: str = "native") -> None:
        self.group = group
        self.name = name
        self.log = log
        initialized = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if initialized and group is not None else 1
        self.rank = dist.get_rank(group) if initialized and group is not None else 0
        self.rs_impl = reduce_scatter_impl

    def _frac(self) -> float:
        return (self.size - 1) / self.size

    def all_reduce(self, t: torch.Tensor, async_op: bool = False, op=None,
                   what: str = "all_reduce") -> Handle:
        if self.size == 1:
            return Handle()
        b = t.numel() * t.element_size()
        self.log.record(self.name, what, 2 * self._frac() * b, what, 2 * self._frac() * b)
        work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group,
                               async_op=async_op)
        return Handle(work) if async_op else _done()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       async_op: bool = False) -> Handle:
        """``out`` (numel B/N) receives this rank's summed shard of ``inp`` (numel B)."""
        if self.size == 1:
            out.copy_(inp)
            return _done()
        b = inp.numel() * inp.element_size()
        logical = self._frac() * b
        if self.rs_impl == "native" and hasattr(dist, "reduce_scatter_single"):
            try:
                work = dist.reduce_scatter_single(out, inp, group=self.group, async_op=async_op)
                self.log.record(self.name, "reduce_scatter", logical, "reduce_scatter", logical)
                return Handle(work) if async_op else _done()
            except (RuntimeError, NotImplementedError):
                self.rs_impl = "all_to_all"
        if self.rs_impl in ("native", "all_to_all"):
            # Each rank sends chunk r to rank r and sums what it receives: the bytes on the wire
            # equal a ring reduce-scatter's; the price is one extra B-sized receive buffer.
            recv = torch.empty_like(inp)
            work = dist.all_to_all_single(recv, inp, group=self.group, async_op=async_op)
            self.log.record(self.name, "reduce_scatter", logical, "all_to_all", logical)

            def finish() -> None:
                torch.sum(recv.view(self.size, -1), dim=0, out=out)

            h = Handle(work, finish)
            if not async_op:
                h.wait()
            return h
        # all_reduce + slice: correct, moves 2x the bytes.
        tmp = inp.clone()
        work = dist.all_reduce(tmp, group=self.group, async_op=async_op)
        self.log.record(self.name, "reduce_scatter", logical, "all_reduce", 2 * logical)
        n = out.numel()
        h = Handle(work, lambda: out.copy_(tmp[self.rank * n:(self.rank + 1) * n]))
        if not async_op:
            h.wait()
        return h

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
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            if use_broadcast:
                for r in range(self.size):
                    piece = views[r, lo:hi]
                    if r == self.rank:
                        piece.copy_(shard[lo:hi])
                    src = dist.get_global_rank(self.group, r)
                    works.append(dist.broadcast(piece, src, group=self.group, async_op=True))
            elif step == n:
                works.append(all_gather_into_tensor(out, shard, group=self.group,
                                                    async_op=True))
            else:
                outs = [views[r, lo:hi] for r in range(self.size)]
                works.append(dist.all_gather(outs, shard[lo:hi].clone(), group=self.group,
                                             async_op=True))
        op = "broadcast" if use_broadcast else "all_gather"
        self.log.record(self.name, "all_gather", logical, op, logical)
        h = Handle(_Many(works))
        if not async_op:
            h.wait()
        return h


class _Many:
    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()


def _done() -> Handle:
    h = Handle()
    h.done = True
    return h
