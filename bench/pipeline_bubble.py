"""Measure the pipeline bubble and activation memory of every schedule: 1F1B, interleaved
1F1B, ZB-H1, ZBV and DualPipeV (and 1F1B with delayed weight gradients).

    python bench/pipeline_bubble.py [--compute sleep|matmul] [--stage-ms 150] [--steps 2]

Four pipeline ranks (gloo, CPU) run the real executor on stand-in chunks, m = 2p and 4p
micro-batches. Each rank measures its busy time (time spent inside chunk forwards, backwards
and weight-gradient steps); the step time runs from the first rank's start (after a barrier)
to the last rank's finish. A rank's bubble is ``(step - busy) / busy``, the quantity
Megatron's formulas give: ``(p - 1) / m`` for 1F1B and ``(p - 1) / (v m)`` for interleaved
1F1B. Equal-cost stages with F = B = W (the zero-bubble paper's assumption): a stage's
forward, input-gradient and weight-gradient steps each take ``stage-ms`` (split over its
chunks); without a split schedule the backward runs both, ``2 x stage-ms``.

Activation memory: each chunk forward keeps two real tensors, one its B needs and one its W
needs (equal halves of a stage's ``ACT_BYTES``), the W half captured by the weight-gradient
closure exactly as the layers' stashes are (:mod:`megazero.tensor_parallel.weight_grad`).
Their lifetimes are tracked with finalizers, so each rank's peak is the bytes the schedule
really kept alive at once, not a count from the schedule.

Compute: this machine may have fewer cores than ranks, and ranks competing for a core would
stretch every compute and blur the bubble. The default ``sleep`` chunks therefore do a small
matmul (real tensors and autograd flow through the pipeline) plus a fixed-duration sleep: a
stage's forward costs ``stage-ms / v`` ms per chunk and its backward twice that, independent of
load. ``--compute matmul`` uses matmul-only chunks instead (honest compute, but contended on a
small machine). Results go to ``bench/results/pipeline_bubble.json``.

Costs: before the schedules run, the same world measures what a pipeline message and an
action cost here (:func:`_measure_costs`): ``p2p_ms``, one activation message to a rank
waiting for it (as the executor posts it), and ``action_overhead_ms``, the time a chunk's F, B
or W spends outside its compute, each after a sleep as in the pipeline. Each row's
``predicted`` is the planner's bubble (:func:`megazero.planner.pipeline_sim.bubble_fraction`)
with those two numbers: the schedule's simulation, not a formula.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.executor import forward_backward
from megazero.pipeline.partition import chunk_roles
from megazero.pipeline.zero_bubble import placement_of
from megazero.planner.pipeline_sim import PipelineCosts, bubble_fraction
from megazero.tensor_parallel import weight_grad
from megazero.tensor_parallel.weight_grad import run_or_defer
from megazero.testing import run_distributed

SEQ, MBS, HIDDEN, VOCAB = 16, 2, 32, 64
ACT_BYTES = 1 << 20  # activations one micro-batch keeps through a whole stage


class Busy:
    """Per-rank accumulator of time spent computing, and of live activation bytes."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.live = 0
        self.peak = 0

    def hold(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, nbytes)
        return t

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


class _Work(torch.autograd.Function):
    """Identity on activations whose forward, input-gradient and weight-gradient parts each
    take a fixed time; it keeps one tensor for B and one for W (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, ms, mode, busy, heavy, act_bytes):
        ctx.ms, ctx.mode, ctx.busy, ctx.heavy = ms, mode, busy, heavy
        ctx.save_for_backward(weight)
        ctx.for_b, ctx.for_w = busy.hold(act_bytes // 2), busy.hold(act_bytes // 2)
        _spend(ms, mode, busy, heavy)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _spend(ctx.ms, ctx.mode, ctx.busy, ctx.heavy)  # B
        (weight,) = ctx.saved_tensors
        ctx.for_b = None
        stash, ms, mode, busy, heavy = ctx.for_w, ctx.ms, ctx.mode, ctx.busy, ctx.heavy
        ctx.for_w = None

        def weight_grad() -> torch.Tensor:
            _spend(ms, mode, busy, heavy)  # W
            return torch.zeros(HIDDEN, HIDDEN) + 0 * stash[0]

        return g, run_or_defer(weight, weight_grad), None, None, None, None, None


def _spend(ms: float, mode: str, busy: Busy, heavy: torch.Tensor) -> None:
    t0 = time.perf_counter()
    if mode == "sleep":
        time.sleep(ms / 1000.0)
    else:  # matmul repetitions calibrated to about ``ms`` on an idle core
        for _ in range(max(1, int(ms))):
            heavy @ heavy
    busy.seconds += time.perf_counter() - t0


class StandInChunk(nn.Module):
    def __init__(self, pre: bool, post: bool, ms: float, mode: str, busy: Busy, reps: int,
                 act_bytes: int):
        super().__init__()
        self.pre, self.post, self.ms, self.mode, self.busy = pre, post, ms, mode, busy
        self.act_bytes = act_bytes
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        self.embedding = nn.Parameter(torch.randn(VOCAB, HIDDEN)) if pre else None
        self.heavy = torch.randn(reps, reps)

    def forward(self, tokens, labels=None, hidden_states=None):
        x = self.embedding[tokens].transpose(0, 1) if self.pre else hidden_states
        x = x + torch.tanh(x @ self.weight)
        x = _Work.apply(x, self.weight, self.ms, self.mode, self.busy, self.heavy,
                        self.act_bytes)
        if self.post:
            return x.pow(2).mean(-1).t()  # a per-token "loss" [b, s]
        return x


def _calibrate_reps() -> int:
    """Matrix size whose product takes about a millisecond on one core."""
    n = 64
    while n < 1024:
        a = torch.randn(n, n)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ a
        if (time.perf_counter() - t0) / 5 > 1e-3:
            return n
        n = int(n * 1.25)
    return n


#: (label, --pipeline-schedule, chunks per rank, delayed W)
SCHEDULES = [("1F1B", None, 1, False), ("interleaved 1F1B", None, 2, False),
             ("1F1B delayed W", None, 1, True), ("ZB-H1", "zb-h1", 1, False),
             ("ZBV", "zbv", 2, False), ("DualPipeV", "dualpipev", 2, False)]


def _measure_costs(rank: int, world_size: int, gap_ms: float, reps: int = 20
                   ) -> tuple[list[float], float]:
    """This rank's one-way message times (ms, as receiver) and its action overhead (ms), both
    measured as the pipeline meets them: after ``gap_ms`` of sleep, not in a hot loop. A
    rank that waits for its neighbour, or has just slept through a compute, wakes to the
    message or the next action on a loaded machine; that wake-up is most of the cost and a
    back-to-back ping-pong or loop does not see it (an order of magnitude less here).

    p2p: rank pairs (0-1, 2-3) take turns; the receiver posts its receive at once (it then
    waits, as a pipeline rank waits on its neighbour), the sender sleeps ``gap_ms`` and posts
    one activation-sized message as the executor does (``batch_isend_irecv``, then wait); the
    time is the receiver's return from the wait less the sender's post (``perf_counter`` is
    the system-wide monotonic clock). Action: F, B (weight gradients deferred) and W of a
    middle chunk whose compute takes no time, each after a ``gap_ms`` sleep; its wall time
    less the zero-length compute."""
    peer = rank ^ 1
    msg = torch.randn(SEQ, MBS, HIDDEN)
    posts, arrivals = [], []
    for i in range(2 * reps):
        dist.barrier()
        if (i + rank) % 2 == 0:  # this rank sends
            time.sleep(gap_ms / 1000)
            posts.append(time.perf_counter())
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, msg, peer)]):
                req.wait()
        else:
            for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty_like(msg),
                                                          peer)]):
                req.wait()
            arrivals.append(time.perf_counter())
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, posts)
    one_way = [1000 * (a - p) for a, p in zip(arrivals, everyone[peer])]
    busy = Busy()
    chunk = StandInChunk(False, False, 0.0, "sleep", busy, 8, ACT_BYTES)
    x = torch.randn(SEQ, MBS, HIDDEN, requires_grad=True)
    spans = []
    for i in range(reps + 2):
        span = 0.0
        busy.seconds = 0.0
        time.sleep(gap_ms / 1000)
        t0 = time.perf_counter()
        out = chunk(None, hidden_states=x)
        span += time.perf_counter() - t0
        time.sleep(gap_ms / 1000)
        t0 = time.perf_counter()
        store = weight_grad.WeightGradStore(list(chunk.parameters()))
        with weight_grad.deferring(store):
            weight_grad.backward([out], [torch.ones_like(out)], [x])
        span += time.perf_counter() - t0
        time.sleep(gap_ms / 1000)
        t0 = time.perf_counter()
        store.run()
        span += time.perf_counter() - t0
        if i >= 2:
            spans.append(1000 * (span - busy.seconds) / 3)
    return one_way, _median(spans)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _bench_rank(rank, world_size, cases, stage_ms, mode, steps):
    reps = _calibrate_reps() if mode == "matmul" else 8
    out = [_measure_costs(rank, world_size, stage_ms / 4)]
    for (_, schedule, vpp, delay), m in cases:
        pp = world_size
        topo = ParallelTopology.build(pp=pp, vpp=vpp if vpp > 1 else None)
        busy = Busy()
        roles = chunk_roles(topo.pp_rank, pp, vpp, placement_of(schedule))
        chunks = [StandInChunk(pre, post, stage_ms / vpp, mode, busy, reps, ACT_BYTES // vpp)
                  for pre, post in roles]
        g = torch.Generator().manual_seed(0)
        batches = [{"tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                    "labels": torch.zeros(MBS, SEQ, dtype=torch.long)} for _ in range(m)]
        spans = []
        for step in range(steps + 1):  # the first step warms up
            busy.seconds, busy.peak = 0.0, busy.live
            dist.barrier()
            t0 = time.perf_counter()
            forward_backward(chunks, iter(batches), topo, m, SEQ, MBS, HIDDEN,
                             schedule=schedule, delay_wgrad=delay)
            t1 = time.perf_counter()
            if step:
                spans.append((t0, t1, busy.seconds, busy.peak))
            for c in chunks:
                c.zero_grad()
        out.append(spans)
    return out


def _step_stats(spans_per_rank: list[list[tuple[float, float, float, int]]]
                ) -> tuple[float, list, list]:
    """Step time = first start to last finish over all ranks (perf_counter is the system-wide
    monotonic clock, comparable across processes): the pipeline is only done when its last
    rank is. Returns the mean step time, each rank's mean busy time and its peak activation
    bytes."""
    steps = len(spans_per_rank[0])
    step_s = sum(max(r[i][1] for r in spans_per_rank) - min(r[i][0] for r in spans_per_rank)
                 for i in range(steps)) / steps
    busy = [sum(s[2] for s in r) / steps for r in spans_per_rank]
    peak = [max(s[3] for s in r) for r in spans_per_rank]
    return step_s, busy, peak


def main() -> None:
    ap = argparse.ArgumentParser(description="pipeline bubble and memory per schedule")
    ap.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    ap.add_argument("--stage-ms", type=float, default=150.0,
                    help="forward (= input-gradient = weight-gradient) time of one micro-batch "
                         "through a whole stage (ms)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "pipeline_bubble.json"))
    args = ap.parse_args()
    pp = 4
    cases = [(s, m) for m in (2 * pp, 4 * pp) for s in SCHEDULES]
    per_rank = run_distributed(_bench_rank, pp, cases, args.stage_ms, args.compute, args.steps,
                               timeout=1200)
    p2p_ms = _median([t for r in per_rank for t in r[0][0]])
    action_ms = _median([r[0][1] for r in per_rank])
    costs = PipelineCosts(p2p_ms / 1000, action_ms / 1000)
    rows = []
    for i, ((label, schedule, v, delay), m) in enumerate(cases):
        step_s, busy, peak = _step_stats([r[i + 1] for r in per_rank])
        bubbles = [(step_s - b) / b for b in busy]
        rows.append(dict(
            schedule=label, pp=pp, vpp=v, microbatches=m,
            formula=(pp - 1) / (v * m) if label in ("1F1B", "interleaved 1F1B") else None,
            predicted=bubble_fraction(schedule or "1f1b", pp, v, m, args.stage_ms / 1000, costs,
                                      delay),
            measured_mean=sum(bubbles) / len(bubbles), measured_max=max(bubbles),
            measured_per_rank=bubbles, step_ms=1000 * step_s,
            busy_ms_per_rank=[1000 * b for b in busy], peak_activation_bytes_per_rank=peak,
            peak_activation_stages=max(peak) / ACT_BYTES))
    for m in (2 * pp, 4 * pp):
        base = next(r for r in rows if r["schedule"] == "1F1B" and r["microbatches"] == m)
        for r in rows:
            if r["microbatches"] == m:
                r["bubble_vs_1f1b"] = r["measured_mean"] / base["measured_mean"]
                r["peak_memory_vs_1f1b"] = (max(r["peak_activation_bytes_per_rank"])
                                            / max(base["peak_activation_bytes_per_rank"]))
    print(f"pipeline bubble, pp={pp}, compute={args.compute} (stage F = B = W = "
          f"{args.stage_ms:g} ms; sleep = fixed-duration compute)")
    print(f"p2p {p2p_ms:.2f} ms per message, {action_ms:.2f} ms per action outside compute")
    print(f"{'schedule':<18}{'v':>3}{'m':>4}{'formula':>9}{'predict':>9}{'bubble':>8}"
          f"{'vs 1F1B':>9}"
          f"{'peak act':>10}{'vs 1F1B':>9}{'step ms':>9}")
    for r in rows:
        formula = "" if r["formula"] is None else f"{r['formula']:.3f}"
        print(f"{r['schedule']:<18}{r['vpp']:>3}{r['microbatches']:>4}{formula:>9}"
              f"{r['predicted']:>9.3f}{r['measured_mean']:>8.3f}{r['bubble_vs_1f1b']:>9.2f}"
              f"{r['peak_activation_stages']:>10.2f}{r['peak_memory_vs_1f1b']:>9.2f}"
              f"{r['step_ms']:>9.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(compute=args.compute, stage_ms=args.stage_ms, steps=args.steps,
                       cpu_count=os.cpu_count(), act_bytes_per_stage=ACT_BYTES,
                       p2p_ms=p2p_ms, action_overhead_ms=action_ms, rows=rows),
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
