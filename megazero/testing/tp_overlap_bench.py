"""The rank function of ``bench/tp_overlap.py``: a stack of sequence-parallel MLP blocks
(column-parallel, GELU, row-parallel) trained forward and backward under each overlap mode,
with every collective and GEMM traced (:func:`megazero.tensor_parallel.overlap.recording`).

The plain mode is :data:`~megazero.tensor_parallel.overlap.NO_OVERLAP`: the same collectives
as the plain layers (one all-gather, one reduce-scatter, each waited for at once), traced the
same way. Exposed communication is, per collective, its time in flight on this rank that no
GEMM of this rank covered; its share is that sum over the step time."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.tensor_parallel.overlap import (
    NO_OVERLAP,
    TPCommOverlap,
    all_gather_linear,
    linear_reduce_scatter,
    recording,
)

MODES = {"plain": NO_OVERLAP, "overlap": TPCommOverlap(),
         "overlap rs-dgrad": TPCommOverlap(rs_dgrad=True)}


def _step(x, layers, group, cfg):
    h = x
    for wc, wr in layers:
        h = h + linear_reduce_scatter(F.gelu(all_gather_linear(h, wc, None, group, cfg)), wr,
                                      group, cfg)
    h.float().pow(2).mean().backward()


def bench_rank(rank: int, world: int, seq: int, hidden: int, ffn: int, num_layers: int,
               rounds: int, warmup: int = 2) -> dict:
    """Per mode: this rank's step times (s) and exposed-communication seconds, per round."""
    group = dist.new_group()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(seq // world, 1, hidden, generator=gen).requires_grad_()
    layers = [(torch.randn(ffn // world, hidden, generator=gen).mul_(0.02).requires_grad_(),
               torch.randn(hidden, ffn // world, generator=gen).mul_(0.02).requires_grad_())
              for _ in range(num_layers)]
    out: dict[str, dict[str, list[float]]] = {m: {"step_s": [], "exposed_s": []} for m in MODES}
    for i in range(warmup + rounds):
        for name, cfg in MODES.items():  # modes interleaved: each round sees the same load
            dist.barrier(group)
            t0 = time.perf_counter()
            with recording() as trace:
                _step(x, layers, group, cfg)
            step = time.perf_counter() - t0
            exposed = sum((c1 - c0) * (1.0 - share) for (_, c0, c1), (_, share)
                          in zip(trace.comms, trace.hidden_shares()))
            if i >= warmup:
                out[name]["step_s"].append(step)
                out[name]["exposed_s"].append(exposed)
    return out


def summarize(per_rank: list[dict]) -> dict:
    """Per mode: medians and spread over rounds of the ranks' mean step time, exposed time
    and exposed share."""
    result = {}
    for name in per_rank[0]:
        n = len(per_rank[0][name]["step_s"])
        steps = [statistics.mean(r[name]["step_s"][i] for r in per_rank) for i in range(n)]
        exposed = [statistics.mean(r[name]["exposed_s"][i] for r in per_rank) for i in range(n)]
        shares = [e / s for e, s in zip(exposed, steps)]
        result[name] = {
            "rounds": n,
            "step_ms_median": 1e3 * statistics.median(steps),
            "step_ms_min": 1e3 * min(steps), "step_ms_max": 1e3 * max(steps),
            "exposed_ms_median": 1e3 * statistics.median(exposed),
            "exposed_share_median": statistics.median(shares),
            "exposed_share_min": min(shares), "exposed_share_max": max(shares),
        }
    return result
