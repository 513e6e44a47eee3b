"""Stage-3 parameter shards in a swap file (``offload_param.device: nvme``).

Each swapped unit's shard has a region of one file; its ``Unit.shard`` becomes a storage-less
("meta") tensor that only carries the shape and dtype (the optimizer's pieces keep views of it).
A gather reads the region into one of ``buffer_count`` host buffers of ``buffer_size`` elements
(read ahead by the prefetch path, see :meth:`megazero.zero.stage3.Stage3Params._prefetch`),
hands it to the all-gather and gives the buffer back. The optimizer reads and writes a piece's
range directly (:meth:`UnitSwap.read_range` / :meth:`UnitSwap.write_range`).

The file is opened without ``O_DIRECT``: the optimizer writes pieces at any element offset,
which ``O_DIRECT``'s alignment rules forbid, so parameter reads may be served by the page cache.
Units whose shards fit in ``max_in_cpu`` elements (taken in order) stay in host memory instead.
"""

from __future__ import annotations

import os

import torch

from megazero.config import ConfigError, ZeroConfig
from megazero.zero.offload import aligned_host_empty, aligned_numel, buffer_count
from megazero.zero.swap import Pending, SwapIO, make_swap_dir


def plan_swapped_units(numels: list[int], zero: ZeroConfig, dp_size: int | list[int],
                       dtype: torch.dtype) -> tuple[list[bool], ParamSwapper | None]:
    """Which stage-3 units (by element count) live in the swap file: those past the first
    ``max_in_cpu`` shard elements; persistent units stay whole on the device. Creates the
    swapper, which checks the buffers and the disk before anything is written. ``dp_size``:
    the size of the group the units are partitioned over, or one per unit (MoE experts are
    partitioned over their expert-data-parallel group)."""
    sizes_of = dp_size if isinstance(dp_size, list) else [dp_size] * len(numels)
    out, kept, sizes = [], 0, []
    for n, group in zip(numels, sizes_of, strict=True):
        shard = -(-n // group)
        nvme = (n >= zero.stage3_param_persistence_threshold
                and kept + shard > zero.offload_param.max_in_cpu)
        kept += 0 if nvme else shard
        out.append(nvme)
        if nvme:
            sizes.append(shard)
    return out, (ParamSwapper(zero, sizes, dtype) if sizes else None)


class ParamSwapper:
    def __init__(self, zero: ZeroConfig, shard_sizes: list[int], dtype: torch.dtype) -> None:
        off = zero.offload_param
        self.dtype = dtype
        self.elem = torch.empty(0, dtype=dtype).element_size()
        biggest = max(shard_sizes, default=0)
        if biggest > off.buffer_size:
            raise ConfigError(f"zero_optimization.offload_param.buffer_size: {off.buffer_size} "
                              f"elements cannot hold this rank's largest parameter shard of "
                              f"{biggest} elements; set buffer_size to at least {biggest}")
        self.width = aligned_numel(max(biggest, 1), self.elem)
        self.offsets, pos = [], 0
        for n in shard_sizes:
            self.offsets.append(pos)
            pos += aligned_numel(n, self.elem) * self.elem
        self.file_bytes = pos
        directory = make_swap_dir(zero, "offload_param", pos, "params")
        self.io = SwapIO(zero.aio)
        self.fd, _ = self.io.open(os.path.join(directory, "params.swp"), pos, direct=False,
                                  key="zero_optimization.offload_param.nvme_path")
        count = buffer_count(zero, "offload_param")
        pool = aligned_host_empty(count * self.width, dtype, off.pin_memory)
        self.free = [pool[i * self.width:(i + 1) * self.width] for i in range(count)]
        #: every host buffer byte this swapper allocated (tests bound it)
        self.allocated_bytes = pool.untyped_storage().nbytes()
        self.pool = pool
        self.reading: dict[int, tuple[torch.Tensor, Pending]] = {}  # slot -> (buffer, read)
        self.fetches = 0  # shards handed to a gather
        self.fetched_ahead = 0  # of those, read ahead by the prefetch path

    def handle(self, slot: int, numel: int) -> UnitSwap:
        return UnitSwap(self, slot, numel)

    def write_shard(self, slot: int, shard: torch.Tensor) -> None:
        self.drop(slot)
        self.io.write(self.fd, shard.detach().to("cpu", self.dtype).contiguous(),
                      self.offsets[slot]).wait()

    def prefetch(self, slot: int, numel: int) -> bool:
        """Start reading ``slot`` into a free buffer, keeping one buffer for a demand read;
        False when no buffer is spare."""
        if slot in self.reading:
            return True
        if len(self.free) <= 1:
            return False
        buf = self.free.pop()[:numel]
        self.reading[slot] = (buf, self.io.read(self.fd, buf, self.offsets[slot]))
        return True

    def requested(self, slot: int) -> bool:
        """Whether a read of ``slot`` was started. Unlike :meth:`ready` this follows from the
        order of calls alone, not from the disk's speed, so collective decisions may use it."""
        return slot in self.reading

    def ready(self, slot: int) -> bool:
        return slot in self.reading and self.reading[slot][1].done()

    def fetch(self, slot: int, numel: int) -> torch.Tensor:
        """The shard's values in a host buffer; give it back with :meth:`give_back`."""
        self.fetches += 1
        if slot in self.reading:
            self.fetched_ahead += 1
        else:
            if not self.free:
                raise RuntimeError("no free parameter swap buffer (all held by reads ahead)")
            buf = self.free.pop()[:numel]
            self.reading[slot] = (buf, self.io.read(self.fd, buf, self.offsets[slot]))
        buf, pending = self.reading.pop(slot)
        pending.wait()
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        base = (buf.data_ptr() - self.pool.data_ptr()) // (self.width * self.elem)
        self.free.append(self.pool[base * self.width:(base + 1) * self.width])

    def drop(self, slot: int) -> None:
        """Forget a read ahead (its region is about to change)."""
        if slot in self.reading:
            buf, pending = self.reading.pop(slot)
            pending.wait()
            self.give_back(buf)


class UnitSwap:
    """One unit's region; what a :class:`~megazero.zero.master.Piece` calls to read or write
    its range of the shard."""

    def __init__(self, swapper: ParamSwapper, slot: int, numel: int) -> None:
        self.swapper, self.slot, self.numel = swapper, slot, numel

    def read_range(self, start: int, n: int) -> torch.Tensor:
        s = self.swapper
        out = torch.empty(n, dtype=s.dtype)
        s.io.read(s.fd, out, s.offsets[self.slot] + start * s.elem).wait()
        return out

    def write_range(self, start: int, values: torch.Tensor) -> None:
        s = self.swapper
        s.drop(self.slot)
        s.io.write(s.fd, values.detach().to("cpu", s.dtype).contiguous(),
                   s.offsets[self.slot] + start * s.elem).wait()
