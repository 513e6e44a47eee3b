"""Collectives through shared memory, for CPU process groups whose ranks share one host.

Gloo moves every byte through the kernel's loopback TCP stack, twice per hop, and sums in its
own worker threads; on a host whose cores all run ranks' compute, those copies are stolen from
the compute. Ranks on one host can instead each keep a flat buffer in shared memory that every
rank maps (:class:`SharedSlots`) and work on those buffers directly. Cut a range of the
buffers into ``N`` chunks, chunk ``r`` belonging to rank ``r`` (:class:`SharedOp`); between two
barriers rank ``r``

* **all-reduce**: sums chunk ``r`` over all buffers into its own (its value first, then the
  others by rank), divides by ``N`` when averaging, and copies the result into chunk ``r`` of
  every other buffer;
* **reduce-scatter**: the same sum, kept in its own buffer only;
* **all-gather**: copies every other rank's chunk of that rank's buffer into its own.

Only rank ``r`` writes chunk ``r`` of a sum, and an all-gather writes only the gathering rank's
buffer, so nothing races; after the second barrier every buffer is its owner's again. An
all-reduce of ``B`` bytes costs each rank ``2B`` of memory traffic, against gloo's ``4B`` of
socket copies plus its sums (``bench/zero_speed.py`` measures both). The barriers are
1-element all-reduces on the group's own backend.

Each rank's buffer is a file in ``/dev/shm`` that the rank creates and reserves
(``posix_fallocate``, so a full tmpfs is an error now and not a SIGBUS later), every rank maps,
and the rank unlinks once all have mapped it: the memory goes away with the last mapping, also
after a crash. :func:`shared_host_group` decides whether a group can use them (gloo, every rank
on this host, ``/dev/shm`` present); anything else uses the backend's collectives.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
SHARED_MEMORY_IMPLS = ("auto", "backend", "shared_memory")


def _host_id() -> str:
    """This machine's identity: hostname plus the kernel's boot id (containers on one host
    that share a hostname but not ``/dev/shm`` differ in neither, so the segment's own test in
    :meth:`SharedSlots.create` has the last word)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_host_group(group: Any, backend: str) -> tuple[bool, str]:
    """Whether ``group`` can use shared-memory buffers, and if not, why. Collective
    over ``group`` (every rank must call it)."""
    if backend != "gloo":
        return False, f"the group's backend is {backend or 'none'}, not gloo"
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, (_host_id(), os.path.isdir(SHM_DIR)), group=group)
    if len({h for h, _ in hosts}) > 1:
        return False, "the group's ranks run on more than one host"
    if not all(ok for _, ok in hosts):
        return False, f"{SHM_DIR} is missing"
    return True, ""


@dataclass
class SharedSlots:
    """One flat buffer per rank of a group, each in shared memory that every rank maps."""

    slots: list[torch.Tensor]  # rank k's buffer, numel elements each
    rank: int

    @property
    def local(self) -> torch.Tensor:
        """This rank's buffer: the tensor callers fill and read (its storage is its own, so
        memory accounting charges each rank one buffer)."""
        return self.slots[self.rank]

    @classmethod
    def create(cls, group: Any, numel: int, dtype: torch.dtype) -> tuple[SharedSlots | None, str]:
        """Map every rank's zeroed buffer on every rank of ``group``; ``(None, reason)`` on
        every rank when any rank cannot (no space in ``/dev/shm``, not the same ``/dev/shm``).
        Collective over ``group``."""
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        nbytes = max(1, numel * torch.empty(0, dtype=dtype).element_size())
        path = os.path.join(SHM_DIR, f"megazero-{os.getpid()}-{uuid.uuid4().hex}")
        reason = ""
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # zeroed pages, reserved now
            finally:
                os.close(fd)
        except OSError as e:
            _unlink(path)
            reason = (f"rank {rank} cannot reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR}: "
                      f"{e.strerror or e}")
        paths: list[Any] = [None] * n
        dist.all_gather_object(paths, (None if reason else path, reason), group=group)
        slots: list[torch.Tensor] = []
        reason = next((r for p, r in paths if p is None), "")
        if not reason:
            try:
                slots = [torch.from_file(p, shared=True, size=numel, dtype=dtype)
                         for p, _ in paths]
            except (OSError, RuntimeError) as e:
                reason = f"rank {rank} cannot map another rank's buffer: {e}"
        ok = torch.tensor([0.0 if reason else 1.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        _unlink(path)  # every rank has mapped it (or given up): the mappings keep it alive
        if ok.item() < 1.0:
            return None, reason or "another rank of the group could not map the buffers"
        return cls(slots, rank), ""

    def owns(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(start, end)`` of ``t`` inside this rank's buffer, if it is a contiguous piece
        of it."""
        local = self.local
        if t.dtype != local.dtype or t.device != local.device or not t.is_contiguous():
            return None
        if t.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
            return None
        start = (t.data_ptr() - local.data_ptr()) // local.element_size()
        if start < 0 or start + t.numel() > local.numel():
            return None
        return start, start + t.numel()

    def apply(self, ops: list[SharedOp]) -> None:
        """Run ``ops`` on this rank's chunks. Call it between two barriers of the group, every
        rank with the same ops: in between, only rank ``r`` writes chunk ``r`` of a sum, and only
        rank ``r``'s own buffer receives the chunks an all-gather copies."""
        n = len(self.slots)
        mine = self.slots[self.rank]
        for op in ops:
            if op.kind == "all_gather":
                for k in range(n):
                    if k != self.rank:
                        a, b = op.chunk(k, n)
                        mine[a:b].copy_(self.slots[k][a:b])
                continue
            a, b = op.chunk(self.rank, n)
            if a >= b:
                continue
            acc = mine[a:b]
            for k in range(n):
                if k != self.rank:
                    acc.add_(self.slots[k][a:b])
            if op.average:
                acc.div_(n)
            if op.kind == "all_reduce":
                for k in range(n):
                    if k != self.rank:
                        self.slots[k][a:b].copy_(acc)


@dataclass(frozen=True)
class SharedOp:
    """One collective on elements ``[lo, hi)`` of every rank's buffer, cut into ``N`` chunks
    (chunk ``r`` belongs to rank ``r``; a range padded to a multiple of ``N`` is cut exactly as
    a reduce-scatter shards it):

    * ``all_reduce``: every buffer gets the sum (``average``: divided by ``N``);
    * ``reduce_scatter``: rank ``r``'s buffer gets the sum in chunk ``r`` (its other chunks
      keep its own values);
    * ``all_gather``: rank ``r``'s buffer gets every rank's chunk of its own buffer."""

    kind: str
    lo: int
    hi: int
    average: bool = False

    def chunk(self, rank: int, n: int) -> tuple[int, int]:
        step = -(-(self.hi - self.lo) // n)
        return self.lo + rank * step, min(self.hi, self.lo + (rank + 1) * step)


def merge_ops(ops: list[SharedOp]) -> list[SharedOp]:
    """Adjacent all-reduces with the same averaging merged (fewer, larger chunks); the others
    keep their chunking, which says which rank owns what."""
    out: list[SharedOp] = []
    for op in sorted(ops, key=lambda o: (o.lo, o.hi)):
        last = out[-1] if out else None
        if (last is not None and op.kind == last.kind == "all_reduce" and last.hi == op.lo
                and last.average == op.average):
            out[-1] = SharedOp("all_reduce", last.lo, op.hi, op.average)
        else:
            out.append(op)
    return out


def another_ranks_buffer(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` is another rank's shared buffer, mapped here to read or write it:
    memory accounting charges each buffer to the rank that made it (its pid is in the name)."""
    name = os.path.basename(storage.filename or "")
    return name.startswith("megazero-") and not name.startswith(f"megazero-{os.getpid()}-")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
