"""The offloaded optimizer step's use of the host: how many CPU threads its update may use, and
how gradients cross from the device into the host staging buffer.

Threads: torchrun sets ``OMP_NUM_THREADS=1`` for every rank, so the CPU Adam of an offloaded
step would run on one core while the node's other cores, its share of them, sit idle (the
device is waiting for the step). During the step the update uses the cores this rank may
claim (:func:`cpus_per_rank`), and the thread count goes back afterwards so that the data
loader and the forward keep the launcher's setting.

Copies: a device-to-host copy into *pinned* memory can be issued ``non_blocking`` (a DMA that
does not stall the host for each piece); the host then waits once, per sub-group, before the
update reads the gradients (:func:`copy_to_host`). Into pageable memory the copy is
synchronous whatever is asked, so the plain path is kept there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def cpus_per_rank(affinity: int, node_cpus: int, local_world: int) -> int:
    """CPU threads one rank's host update may use: the CPUs it may run on (``affinity``) shared
    with the other ranks of its node (``local_world``), unless the launcher already bound it to
    fewer than the node's CPUs (``--cpu-bind``, ``taskset``: that set is its share)."""
    if affinity < node_cpus:
        return max(1, affinity)
    return max(1, affinity // max(1, local_world))


def step_threads() -> int:
    """:func:`cpus_per_rank` for this process: its CPU affinity, the node's CPU count and the
    ranks on this node (``LOCAL_WORLD_SIZE``, set by torchrun; 1 when absent)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        affinity = os.cpu_count() or 1
    node = os.cpu_count() or affinity
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return cpus_per_rank(affinity, node, local)


@contextmanager
def host_threads(n: int) -> Iterator[None]:
    """Inside, torch's intra-op pool has ``n`` threads; the previous count is restored after."""
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)


def non_blocking_copy(sources: Sequence[torch.Tensor], dest: torch.Tensor) -> bool:
    """Whether copies of ``sources`` into ``dest`` may be issued ``non_blocking``: device
    (CUDA) sources into a pinned host buffer. Then the host must synchronise before reading."""
    return dest.device.type == "cpu" and dest.is_pinned() and any(
        s.device.type == "cuda" for s in sources)


def copy_to_host(sources: Sequence[torch.Tensor], dest: torch.Tensor) -> list[torch.Tensor]:
    """Copy each of ``sources`` (flattened) into consecutive ranges of the host buffer
    ``dest``; returns the views. Pinned ``dest``: every copy is issued non-blocking, then one
    synchronisation of the sources' stream for them all."""
    asynchronous = non_blocking_copy(sources, dest)
    out, pos = [], 0
    for s in sources:
        n = s.numel()
        out.append(dest[pos:pos + n].copy_(s.reshape(-1), non_blocking=asynchronous))
        pos += n
    if asynchronous:
        device = next(s.device for s in sources if s.device.type == "cuda")
        torch.cuda.current_stream(device).synchronize()
    return out
