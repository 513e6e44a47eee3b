"""The collective rows: each collective a job uses, at its sizes, checked and timed.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md``): ``algbw = bytes / time`` and
``busbw = algbw * factor``, the factor making every collective comparable with the link's
speed: ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for reduce-scatter and all-gather (bytes = the
full, unsharded tensor), 1 for broadcast and send/recv. The largest size of each collective is
judged against ``min_fraction`` of the link's nominal one-direction figure (``--nominal-gbps``,
or a default for known GPUs); smaller sizes and CPU runs are reported only. Each result is also
checked for its values, so a collective that returns garbage fails whatever its speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megazero.cluster_check import Row
from megazero.distributed import collectives

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "sendrecv")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def bus_bandwidth_gbps(op: str, nbytes: int, seconds: float, n: int) -> float:
    """nccl-tests' busbw in GB/s (1e9 bytes) for one collective of ``nbytes`` in ``seconds``."""
    return nbytes / seconds / 1e9 * bus_factor(op, n) if seconds > 0 else 0.0


# Nominal one-direction GB/s per GPU: within a node (NVLink, or PCIe for the PCIe boards) and
# across nodes (the usual one NIC per GPU: 400 Gb/s NDR for Hopper/Blackwell, 200 Gb/s HDR for
# Ampere). First matching name wins.
NOMINAL_GBPS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 64.0, 50.0), ("H100 NVL", 300.0, 50.0), ("H800", 200.0, 50.0),
    ("H100", 450.0, 50.0), ("H200", 450.0, 50.0), ("GH200", 450.0, 50.0),
    ("B200", 900.0, 50.0), ("B100", 900.0, 50.0),
    ("A100-PCIE", 32.0, 25.0), ("A100 PCIe", 32.0, 25.0), ("A800", 200.0, 25.0),
    ("A100", 300.0, 25.0), ("L40S", 32.0, 25.0), ("L4", 32.0, 25.0))


def nominal_gbps(device_name: str | None, nodes: int) -> float | None:
    """The default nominal figure for a device kind (None: unknown, report only)."""
    if not device_name:
        return None
    for key, intra, inter in NOMINAL_GBPS:
        if key.lower() in device_name.lower():
            return inter if nodes > 1 else intra
    return None


def _fill(t: torch.Tensor, value: float) -> torch.Tensor:
    return t.fill_(value)


def _wait(work: object) -> None:
    wait = getattr(work, "wait", None)
    if wait is not None:
        wait()


@dataclass(frozen=True)
class Link:
    """Where a collective runs: its group (None: the world), this rank's peers for send/recv
    (global ranks), and how many nodes the group spans (which nominal figure applies)."""

    axis: str
    group: Any
    ranks: list[int]
    send_to: int = 0
    recv_from: int = 0


def _op(op: str, nbytes: int, device: torch.device, link: Link
        ) -> tuple[Callable[[], object], Callable[[], bool]]:
    """(run once, check the values of the last run) for ``op`` over ``link``'s group, through
    :mod:`megazero.distributed.collectives` where the job does (its reduce-scatter on gloo is an
    all-to-all)."""
    group = link.group
    n, r = len(link.ranks), link.ranks.index(dist.get_rank())
    numel = max(n, nbytes // 4 // n * n)
    if op == "all_reduce":
        t = torch.empty(numel, device=device)
        return (lambda: dist.all_reduce(_fill(t, r + 1.0), group=group),
                lambda: bool((t == n * (n + 1) / 2).all()))
    if op == "reduce_scatter":
        src, out = torch.empty(numel, device=device), torch.empty(numel // n, device=device)
        impl = collectives.reduce_scatter_impl("auto", collectives.backend_of(group))
        return (lambda: collectives.reduce_scatter(out, _fill(src, r + 1.0), group, impl),
                lambda: bool((out == n * (n + 1) / 2).all()))
    if op == "all_gather":
        mine, out = torch.empty(numel // n, device=device), torch.empty(numel, device=device)
        want = torch.arange(1, n + 1, device=device, dtype=out.dtype).repeat_interleave(numel // n)
        return (lambda: _wait(collectives.all_gather(out, _fill(mine, r + 1.0), group)),
                lambda: bool(torch.equal(out, want)))
    if op == "broadcast":
        t = torch.empty(numel, device=device)
        return (lambda: dist.broadcast(_fill(t, 7.0 if r == 0 else -1.0), src=link.ranks[0],
                                       group=group),
                lambda: bool((t == 7.0).all()))
    # send/recv: to the next neighbour, from the previous one (pipeline stages, or a ring)
    send, recv = torch.empty(numel, device=device), torch.empty(numel, device=device)
    me = dist.get_rank()

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, _fill(send, me + 1.0), link.send_to),
               dist.P2POp(dist.irecv, recv, link.recv_from)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return exchange, lambda: bool((recv == link.recv_from + 1.0).all())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(op: str, nbytes: int, device: torch.device, link: Link, iters: int,
            warmup: int = 2) -> tuple[float, bool]:
    """Collective over the world: (seconds per call, the slowest rank's; values right on
    every rank)."""
    run, check = _op(op, nbytes, device, link)
    for _ in range(warmup):
        run()
    _sync(device)
    ok = check()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    seconds = (time.perf_counter() - t0) / iters
    ok = ok and check()
    flags = torch.tensor([seconds, 0.0 if ok else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return float(flags[0]), flags[1].item() == 0.0


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def links(topo: Any) -> dict[str, Link]:
    """The groups a job of ``topo``'s layout talks over, by collective: the data-parallel
    group's gradient reduce-scatter / all-reduce and parameter all-gather, the tensor-parallel
    group's activation all-reduce, a broadcast over the world, send/recv between pipeline
    neighbours (a ring over the world when there is no pipeline)."""
    world = list(range(dist.get_world_size()))
    me = dist.get_rank()
    out = {"world": Link("world", None, world, (me + 1) % len(world), (me - 1) % len(world))}
    if topo.dp_size > 1:
        out["dp"] = Link("dp", topo.dp_group, topo.ranks("dp"))
    if topo.tp_size > 1:
        out["tp"] = Link("tp", topo.tp_group, topo.ranks("tp"))
    if topo.pp_size > 1:
        out["pp"] = Link("pp", topo.pp_group, topo.ranks("pp"), topo.next_pp_rank,
                         topo.prev_pp_rank)
    return out


def plan(available: dict[str, Link]) -> list[tuple[str, str]]:
    """(axis, collective) pairs to run, in order."""
    out: list[tuple[str, str]] = []
    if "dp" in available:
        out += [("dp", "all_reduce"), ("dp", "reduce_scatter"), ("dp", "all_gather")]
    if "tp" in available:
        out += [("tp", "all_reduce"), ("tp", "reduce_scatter"), ("tp", "all_gather")]
    out.append(("world", "broadcast"))
    out.append(("pp", "sendrecv") if "pp" in available else ("world", "sendrecv"))
    return out


def collective_rows(topo: Any, sizes: dict[str, list[int]], device: torch.device,
                    nominal: Callable[[int], float | None], min_fraction: float,
                    iters: int) -> list[Row]:
    """Collective: one row per (group, collective, size); ``sizes``: collective -> bytes;
    ``nominal(nodes)``: the link's figure for a group spanning that many nodes."""
    if dist.get_world_size() == 1:
        return [Row("collectives", "SKIP", "a world of one rank has no peers to talk to")]
    import socket

    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    available = links(topo)
    rows = []
    for axis, op in plan(available):
        link = available[axis]
        n = len(link.ranks)
        # every group of this axis runs at once; judge by the widest (most nodes) of them
        spans = torch.tensor([len({hosts[r] for r in link.ranks})], device=device)
        dist.all_reduce(spans, op=dist.ReduceOp.MAX)
        figure = nominal(int(spans.item()))
        biggest = max(sizes[op])
        for nbytes in sorted(sizes[op]):
            seconds, ok = time_op(op, nbytes, device, link, iters)
            bw = bus_bandwidth_gbps(op, nbytes, seconds, n)
            what = f"busbw {bw:8.2f} GB/s ({1e3 * seconds:.2f} ms, {n} ranks)"
            name = f"{axis} {op} {_size(nbytes)}"
            if not ok:
                rows.append(Row(name, "FAIL", f"wrong values in the result; {what}"))
            elif figure is None or nbytes != biggest:
                rows.append(Row(name, "PASS", f"{what}, report only"))
            elif bw >= min_fraction * figure:
                rows.append(Row(name, "PASS", f"{what} = {bw / figure:.0%} of nominal "
                                              f"{figure:g} GB/s"))
            else:
                rows.append(Row(name, "FAIL", f"{what} = {bw / figure:.0%} of nominal "
                                              f"{figure:g} GB/s, under {min_fraction:.0%} "
                                              "(check NVLink/NIC and NCCL_* settings)"))
    return rows


def job_sizes(base: list[int], hidden: int | None, seq: int | None, micro: int | None,
              bucket_elements: int | None) -> dict[str, list[int]]:
    """Byte sizes per collective: ``base`` for every one, plus the job's own when its flags are
    given: the activation (micro x seq x hidden in 16-bit) for send/recv and the tensor-parallel
    all-reduce, a gradient bucket (fp32) for all-reduce / reduce-scatter, its 16-bit parameters
    for all-gather and broadcast."""
    out = {op: sorted(set(base)) for op in OPS}
    if hidden and seq and micro:
        for op in ("sendrecv", "all_reduce"):
            out[op] = sorted({*out[op], 2 * micro * seq * hidden})
    if bucket_elements:
        for op, width in (("all_reduce", 4), ("reduce_scatter", 4), ("all_gather", 2),
                          ("broadcast", 2)):
            out[op] = sorted({*out[op], width * bucket_elements})
    return out
