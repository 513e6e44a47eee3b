"""The per-rank rows: each rank's compute and link timing against the others, naming a slow one.

A collective's bus bandwidth is the group's: one throttled rank (a GPU stuck at low clocks, a CPU
quota, a noisy neighbour, a bad NIC) makes every collective as slow as it is, and the table's
collective rows show a slow cluster without saying where. These rows time each rank on its own:

- **compute**: every rank runs the same GEMMs at the same time and times them; a rank more than
  ``factor`` times slower than the other ranks' median fails, named;
- **links**: in rounds of a round-robin every rank exchanges a buffer with one peer, so each
  rank meets every other once; a rank's figure is the median over its peers. A slow rank is
  slow with every peer, a healthy rank with one (the slow rank), so the median names the slow
  one. With two ranks there is one link and nothing
  to compare it with (the compute row still tells the two apart).

Each is the median of ``repeats`` timings, so a moment's noise does not fail a healthy rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megazero.cluster_check import Row

#: a rank this many times slower than the median rank fails
SLOW_FACTOR = 2.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather(value: float, device: torch.device) -> list[float]:
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t.item()) for t in out]


def gemm_seconds(device: torch.device, n: int, count: int, repeats: int) -> float:
    """This rank's median time for ``count`` products of two ``n x n`` matrices."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)
    torch.mm(a, b, out=c)  # warm up
    times = []
    for _ in range(repeats):
        dist.barrier()  # every rank computes at the same time, as in training
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(count):
            torch.mm(a, b, out=c)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pairings(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of a round-robin over ``n`` ranks (the circle method): every pair of ranks meets
    in exactly one round, and no rank is in two pairs of a round (with ``n`` odd one rank sits
    each round out)."""
    players = list(range(n)) + ([-1] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if a >= 0 and b >= 0])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def exchange_seconds(device: torch.device, nbytes: int, repeats: int,
                     per_timing: int) -> list[float]:
    """This rank's median time of ``per_timing`` exchanges with each peer it meets in a
    round-robin (:func:`pairings`): one time per peer; every rank runs the same rounds at the
    same time, each in one pair."""
    me = dist.get_rank()
    send = torch.ones(max(1, nbytes // 4), device=device)
    recv = torch.empty_like(send)
    out = []
    for pairs in pairings(dist.get_world_size()):
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        times = []
        for _ in range(repeats + 1):  # the first one connects the pair: not timed
            dist.barrier()
            if peer is None:  # this rank sits the round out
                continue
            t0 = time.perf_counter()
            for _ in range(per_timing):
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            _sync(device)
            times.append(time.perf_counter() - t0)
        if times:
            out.append(statistics.median(times[1:]))
    return out


def judge(name: str, what: str, seconds: list[float], factor: float) -> list[Row]:
    """One row per rank: FAIL for a rank more than ``factor`` times the other ranks' median."""
    rows = []
    for r, s in enumerate(seconds):
        med = statistics.median(seconds[:r] + seconds[r + 1:])  # the other ranks'
        ratio = s / med if med > 0 else 1.0
        detail = f"{what} {s * 1e3:.2f} ms, {ratio:.2f}x the other ranks' median " \
                 f"({med * 1e3:.2f} ms)"
        if ratio > factor:
            rows.append(Row(f"rank {r} {name}", "FAIL", f"{detail}: over {factor:g}x, a slow "
                            "rank (throttled or shared device, CPU quota, noisy neighbour)"))
        else:
            rows.append(Row(f"rank {r} {name}", "PASS", detail))
    return rows


def per_rank_rows(device: torch.device, nbytes: int, factor: float = SLOW_FACTOR,
                  repeats: int = 5) -> list[Row]:
    """Collective: the compute row and the link row of every rank (see the module docstring)."""
    n = dist.get_world_size()
    if n == 1:
        return [Row("per-rank timing", "SKIP", "a world of one rank has nobody to compare with")]
    gpu = device.type == "cuda"
    # each timing long enough (0.1-0.3 s on a CPU core) that a rank throttled in slices of a
    # scheduler's period cannot finish it inside one slice
    size, count, per_timing = (4096, 20, 8) if gpu else (512, 24, 64)
    rows = judge("compute", f"{count} GEMMs of {size}x{size}:",
                 _gather(gemm_seconds(device, size, count, repeats), device), factor)
    if n == 2:
        rows.append(Row("per-rank links", "SKIP", "two ranks share one link: nothing to compare "
                                                  "it with (the compute rows tell them apart)"))
        return rows
    mine = statistics.median(exchange_seconds(device, nbytes, repeats, per_timing))
    rows += judge("links", f"exchanging {nbytes / 2**20:g} MiB {per_timing}x with each peer:",
                  _gather(mine, device), factor)
    return rows
