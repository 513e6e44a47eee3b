"""All-reduce through shared memory, for CPU process groups whose ranks share one host.

Gloo moves every byte of an all-reduce through the kernel's loopback TCP stack, twice per
hop, and sums in its own worker threads; on a host whose cores all run ranks' compute those
copies are stolen from the compute. Ranks on one host can instead map one segment holding every
rank's copy of a flat buffer (``slots``) and reduce it in place:

1. barrier (every rank's values are in its slot);
2. rank ``r`` sums chunk ``r`` of the range over all slots into its own slot (fixed order:
   its own value, then the others by rank), divides by ``N`` when averaging, and copies the
   result into chunk ``r`` of every other slot;
3. barrier (every chunk is written everywhere).

Between the two barriers only rank ``r`` touches chunk ``r`` of any slot, so nothing races;
after the second, every rank's slot holds the same reduced values and is its own again. Each
rank reads ``N`` and writes ``N`` chunk-sized pieces: ``2B`` of memory traffic for a buffer of
``B`` bytes, against gloo's ``4B`` of socket copies plus its sums (measured in
``bench/zero_speed.py``). The barriers are 1-element all-reduces on the group's own backend.

Each rank's buffer is a file in ``/dev/shm`` that the rank creates and reserves
(``posix_fallocate``, so a full tmpfs is an error now and not a SIGBUS later), every rank maps,
and the rank unlinks once all have mapped it: the memory goes away with the last mapping, also
after a crash.
:func:`shared_host_group` decides whether a group can use it (gloo, every rank on this host,
``/dev/shm`` present); anything else uses the backend's all-reduce.
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
ALL_REDUCE_IMPLS = ("auto", "backend", "shared_memory")


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
    """Whether ``group`` can all-reduce through shared memory, and if not, why. Collective
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
    """One flat buffer per rank of ``group``, each in shared memory that every rank maps."""

    slots: list[torch.Tensor]  # rank k's buffer, numel elements each
    rank: int
    group: Any
    flag: torch.Tensor  # the barriers' 1-element all-reduce

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
        return cls(slots, rank, group, torch.zeros(1)), ""

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

    def barrier(self) -> None:
        dist.all_reduce(self.flag, group=self.group)

    def reduce(self, ranges: list[tuple[int, int, bool]]) -> None:
        """Sum ``[start, end)`` of every rank's buffer into every rank's buffer, for each range
        (``True``: then divide by ``N``). Collective: every rank passes the same ranges."""
        n = len(self.slots)
        self.barrier()
        for lo, hi, average in ranges:
            step = -(-(hi - lo) // n)
            a, b = lo + self.rank * step, min(hi, lo + (self.rank + 1) * step)
            if a >= b:
                continue
            mine = self.slots[self.rank][a:b]
            for k in range(n):
                if k != self.rank:
                    mine.add_(self.slots[k][a:b])
            if average:
                mine.div_(n)
            for k in range(n):
                if k != self.rank:
                    self.slots[k][a:b].copy_(mine)
        self.barrier()


def merge_ranges(ranges: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """Adjacent ranges with the same averaging merged (fewer, larger chunks), in order."""
    out: list[tuple[int, int, bool]] = []
    for lo, hi, avg in sorted(ranges):
        if out and out[-1][1] == lo and out[-1][2] == avg:
            out[-1] = (out[-1][0], hi, avg)
        else:
            out.append((lo, hi, avg))
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
