"""The rank function of ``bench/tp_overlap.py``: a stack of sequence-parallel MLP blocks
(column-parallel, GELU, row-parallel) trained forward and backward under each overlap mode,
with every collective and GEMM traced (:func:`megazero.tensor_parallel.overlap.recording`).

The plain mode is :data:`~megazero.tensor_parallel.overlap.NO_OVERLAP`: the same collectives
as the plain layers (one all-gather, one reduce-scatter, each waited for at once), traced the
same way. Exposed communication is, per collective, its time in flight on this rank that no
GEMM of this rank covered; its share is that sum over the step time.

Each round also times, on the same ranks under the same load, what the planner needs to
predict that share (:func:`machine_round`): the rate of the blocks' GEMM, the GELU forward and
backward, and the all-gather, reduce-scatter and ring step of the tensors the blocks move, at
their size and at 1/8 of it (two sizes give a call's latency apart from its bandwidth).
:func:`predict` turns those numbers into a cluster description and prices the step with the
step-time model's TP term (:func:`megazero.planner.tp_cost.linear_pair_tp_seconds`): nothing
in it is fitted to the shares it is compared with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.planner.cluster import Cluster
from megazero.planner.links import wire_bytes
from megazero.planner.tp_cost import linear_pair_tp_seconds
from megazero.tensor_parallel.overlap import (
    NO_OVERLAP,
    TPCommOverlap,
    _ring_step,
    all_gather_async,
    all_gather_linear,
    linear_reduce_scatter,
    recording,
    reduce_scatter_async,
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
    out["machine"] = {}
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
        machine = machine_round(x, layers[0][0], group)
        if i >= warmup:
            for k, v in machine.items():
                out["machine"].setdefault(k, []).append(v)
    return out


def _timed(fn: Callable[[], object], group, before: Callable[[], object] | None = None
           ) -> float:
    """Seconds of ``fn()`` on this rank, the ranks released together from a barrier and, with
    ``before``, each running it first (untimed)."""
    dist.barrier(group)
    if before is not None:
        before()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine_round(x: torch.Tensor, wc: torch.Tensor, group) -> dict[str, float]:
    """Seconds, on this rank, of the blocks' column GEMM (``gemm_s``, its FLOPs in
    ``gemm_flops``), a GELU forward + backward on its output (``gelu_s``), and the collectives
    of the activation (``all_gather``, ``reduce_scatter``: the full sequence's bytes; ring step
    ``send_recv``: a 1/tp chunk), each at that size and at 1/8 of it (``..._8``), the median
of three. Each
    collective is timed right after that GEMM, as in the step: on a host whose cores other
    work shares, the ranks leave a GEMM at different times, and the wait for the last one is
    part of what a collective costs there."""
    world = dist.get_world_size(group)
    with torch.no_grad():
        full = torch.cat([x.detach()] * world)

        def gemm() -> torch.Tensor:
            return F.linear(full, wc)

        out = {"gemm_s": _timed(gemm, group),
               "gemm_flops": 2.0 * full.shape[0] * full.shape[-1] * wc.shape[0]}
        a = gemm()
        out["gelu_s"] = _timed(lambda: torch.ops.aten.gelu_backward(F.gelu(a), a), group)
        for tag, rows in (("", x.shape[0]), ("_8", x.shape[0] // 8)):
            part = x.detach()[:rows].contiguous()
            whole = torch.cat([part] * world)
            recv = torch.empty_like(part)
            runs = {"all_gather": lambda p=part: all_gather_async(p, group)[1].wait(),
                    "reduce_scatter": lambda w=whole: reduce_scatter_async(w, group)[1].wait(),
                    "send_recv": lambda p=part, r=recv: _ring_step(p, r, group, "ring").wait()}
            for kind, fn in runs.items():  # the median of 3: one late peer is one sample
                out[kind + tag] = statistics.median(_timed(fn, group, gemm) for _ in range(3))
        out["bytes"] = float(x.numel() * x.element_size() * world)  # the full activation
    return out


def summarize(per_rank: list[dict]) -> dict:
    """Per mode: medians and spread over rounds of the ranks' mean step time, exposed time
    and exposed share; under ``machine``, the medians (and min, max) over rounds of the ranks'
    mean machine numbers."""
    result: dict = {}
    for name in per_rank[0]:
        if name == "machine":
            continue
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
    machine = {}
    for k, v in per_rank[0]["machine"].items():
        rounds = [statistics.mean(r["machine"][k][i] for r in per_rank) for i in range(len(v))]
        machine[k] = {"median": statistics.median(rounds), "min": min(rounds),
                      "max": max(rounds)}
    result["machine"] = machine
    return result


def machine_cluster(machine: dict, tp: int) -> Cluster:
    """The gloo ranks as the planner's cluster description: the measured GEMM rate as the
    peak (``achievable_fraction`` 1), and per collective kind the latency and bandwidth of
    the two measured sizes, ``alpha + wire / beta`` through both points."""
    med = {k: v["median"] for k, v in machine.items()}
    full = med["bytes"]
    sizes = {"all_gather": full, "reduce_scatter": full, "send_recv": full / tp}
    collectives = {}
    for kind, nbytes in sizes.items():
        w1, w8 = wire_bytes(kind, nbytes, tp), wire_bytes(kind, nbytes / 8, tp)
        t1, t8 = med[kind], med[kind + "_8"]
        beta = (w1 - w8) / max(t1 - t8, 1e-9)  # bytes/s
        alpha = max(0.0, t1 - w1 / beta)
        collectives[kind] = [alpha * 1e6, beta / 1e9]
    rate = med["gemm_flops"] / med["gemm_s"]
    return Cluster(name="gloo bench", device="host CPU (gloo)", memory_gb=0.0,
                   peak_tflops_16=rate / 1e12, peak_tflops_32=rate / 1e12, gpus_per_node=tp,
                   intra_node_gbps=collectives["send_recv"][1], inter_node_gbps=0.0,
                   pcie_gbps=0.0, host_memory_gb=0.0, cpu_adam_gparams_per_s=0.0,
                   achievable_fraction=1.0, comm_overlaps_compute=True,
                   collectives=collectives)


def predict(config: dict, machine: dict, tp: int) -> dict[str, dict[str, float]]:
    """The planner's exposed TP milliseconds, step milliseconds and share per mode (plain,
    overlap) for ``config``'s blocks at ``tp``: per block six GEMMs (forward, input and
    weight gradient of the column and the row linear, the same FLOPs each), one GELU forward
    + backward, and one linear pair's exposed collectives. The overlap's GEMM chunking
    (:func:`megazero.planner.tp_cost.overlap_chunking_seconds`) is left out: the cluster built
    from the machine numbers states no ``gemm_half_rate_rows`` (bench/chunked_gemm.py fits ~10
    rows on a CPU, about 1% of the chunked GEMMs here)."""
    cluster = machine_cluster(machine, tp)
    med = {k: v["median"] for k, v in machine.items()}
    gemm = med["gemm_flops"] / cluster.gemm_rate(False)
    compute = config["layers"] * (6 * gemm + med["gelu_s"])
    out = {}
    for mode, overlap in (("plain", False), ("overlap", True)):
        exposed = config["layers"] * linear_pair_tp_seconds(
            cluster, med["bytes"], tp, cluster.intra_node_gbps, gemm, overlap)
        out[mode] = {"exposed_ms": 1e3 * exposed, "step_ms": 1e3 * (compute + exposed),
                     "exposed_share": exposed / (compute + exposed)}
    return out
