"""Measure the pipeline bubble of 1F1B and interleaved 1F1B and compare with the formulas.

    python bench/pipeline_bubble.py [--compute sleep|matmul] [--stage-ms 200] [--steps 3]

Four pipeline ranks (gloo, CPU) run the real executor on stand-in chunks. Each rank measures
its busy time (time spent inside chunk forwards and backwards); the step time runs from the
first rank's start (after a barrier) to the last rank's finish. A rank's bubble is
``(step - busy) / busy``, the quantity Megatron's formulas give:
``(p - 1) / m`` for 1F1B and ``(p - 1) / (v m)`` for interleaved 1F1B.

Compute: this machine may have fewer cores than ranks, and ranks competing for a core would
stretch every compute and blur the bubble. The default ``sleep`` chunks therefore do a small
matmul (real tensors and autograd flow through the pipeline) plus a fixed-duration sleep: a
stage's forward costs ``stage-ms / v`` ms per chunk and its backward twice that, independent of
load. ``--compute matmul`` uses matmul-only chunks instead (honest compute, but contended on a
small machine). Results go to ``bench/results/pipeline_bubble.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.executor import forward_backward
from megazero.pipeline.partition import chunk_roles
from megazero.testing import run_distributed

SEQ, MBS, HIDDEN, VOCAB = 16, 2, 32, 64


class Busy:
    """Per-rank accumulator of time spent computing."""

    def __init__(self) -> None:
        self.seconds = 0.0


class _Work(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time (sleep or matmul)."""

    @staticmethod
    def forward(ctx, x, ms, mode, busy, heavy):
        ctx.ms, ctx.mode, ctx.busy, ctx.heavy = ms, mode, busy, heavy
        _spend(ms, mode, busy, heavy)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _spend(2 * ctx.ms, ctx.mode, ctx.busy, ctx.heavy)
        return g, None, None, None, None


def _spend(ms: float, mode: str, busy: Busy, heavy: torch.Tensor) -> None:
    t0 = time.perf_counter()
    if mode == "sleep":
        time.sleep(ms / 1000.0)
    else:  # matmul repetitions calibrated to about ``ms`` on an idle core
        for _ in range(max(1, int(ms))):
            heavy @ heavy
    busy.seconds += time.perf_counter() - t0


class StandInChunk(nn.Module):
    def __init__(self, pre: bool, post: bool, ms: float, mode: str, busy: Busy, reps: int):
        super().__init__()
        self.pre, self.post, self.ms, self.mode, self.busy = pre, post, ms, mode, busy
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        self.embedding = nn.Parameter(torch.randn(VOCAB, HIDDEN)) if pre else None
        self.heavy = torch.randn(reps, reps)

    def forward(self, tokens, labels=None, hidden_states=None):
        x = self.embedding[tokens].transpose(0, 1) if self.pre else hidden_states
        x = x + torch.tanh(x @ self.weight)
        x = _Work.apply(x, self.ms, self.mode, self.busy, self.heavy)
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


def _bench_rank(rank, world_size, cases, stage_ms, mode, steps):
    reps = _calibrate_reps() if mode == "matmul" else 8
    out = []
    for pp, vpp, m in cases:
        topo = ParallelTopology.build(pp=pp, vpp=vpp if vpp > 1 else None)
        busy = Busy()
        chunks = [StandInChunk(pre, post, stage_ms / vpp, mode, busy, reps)
                  for pre, post in chunk_roles(topo.pp_rank, pp, vpp)]
        g = torch.Generator().manual_seed(0)
        batches = [{"tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                    "labels": torch.zeros(MBS, SEQ, dtype=torch.long)} for _ in range(m)]
        spans = []
        for step in range(steps + 1):  # the first step warms up
            busy.seconds = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            forward_backward(chunks, iter(batches), topo, m, SEQ, MBS, HIDDEN)
            t1 = time.perf_counter()
            if step:
                spans.append((t0, t1, busy.seconds))
        out.append(spans)
    return out


def _step_stats(spans_per_rank: list[list[tuple[float, float, float]]]) -> tuple[float, list]:
    """Step time = first start to last finish over all ranks (perf_counter is the system-wide
    monotonic clock, comparable across processes): the pipeline is only done when its last
    rank is. Returns the mean step time and each rank's mean busy time."""
    steps = len(spans_per_rank[0])
    step_s = sum(max(r[i][1] for r in spans_per_rank) - min(r[i][0] for r in spans_per_rank)
                 for i in range(steps)) / steps
    busy = [sum(s[2] for s in r) / steps for r in spans_per_rank]
    return step_s, busy


def main() -> None:
    ap = argparse.ArgumentParser(description="pipeline bubble: measured vs formula")
    ap.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    ap.add_argument("--stage-ms", type=float, default=200.0,
                    help="forward time of one micro-batch through a whole stage (ms)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "pipeline_bubble.json"))
    args = ap.parse_args()
    pp = 4
    cases = [(pp, 1, 4), (pp, 1, 8), (pp, 2, 4), (pp, 2, 8)]
    per_rank = run_distributed(_bench_rank, pp, cases, args.stage_ms, args.compute, args.steps,
                               timeout=600)
    rows = []
    for i, (p, v, m) in enumerate(cases):
        step_s, busy = _step_stats([r[i] for r in per_rank])
        bubbles = [(step_s - b) / b for b in busy]
        rows.append(dict(
            schedule="1F1B" if v == 1 else "interleaved 1F1B", pp=p, vpp=v, microbatches=m,
            formula=(p - 1) / (v * m), measured_mean=sum(bubbles) / len(bubbles),
            measured_per_rank=bubbles, step_ms=1000 * step_s,
            busy_ms_per_rank=[1000 * b for b in busy]))
    print(f"pipeline bubble, pp={pp}, compute={args.compute} "
          f"(stage forward {args.stage_ms:g} ms, backward 2x; sleep = fixed-duration compute)")
    print(f"{'schedule':<18}{'v':>3}{'m':>4}{'formula':>10}{'measured':>10}"
          f"{'per rank':>30}{'step ms':>10}")
    for r in rows:
        per = " ".join(f"{b:.3f}" for b in r["measured_per_rank"])
        print(f"{r['schedule']:<18}{r['vpp']:>3}{r['microbatches']:>4}{r['formula']:>10.3f}"
              f"{r['measured_mean']:>10.3f}{per:>30}{r['step_ms']:>10.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(compute=args.compute, stage_ms=args.stage_ms, steps=args.steps,
                       cpu_count=os.cpu_count(), rows=rows), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
