"""Step time of an MoE model against the dense model of equal active parameters.

    python bench/moe_step.py [--iters 12] [--hidden 128] [--experts 8] [--topk 2]

Runs ``pretrain_gpt.py`` (mock data, fp32, gloo) for: the dense model whose MLP width is
``topk x`` the expert width (the same active MLP parameters per token), the MoE model on one
process (expert loop, ``--moe-grouped-gemm``), then both on 2 processes, dense at DP 2 and MoE
at EP 2 with each dispatcher (``allgather``, ``alltoall``) and grouped GEMM on and off, and at
expert tensor parallel 2 (every expert split over both processes). Reports
the median iteration time over the iterations after the first two (with min-max spread), the
MoE/dense ratio on the same process count, and writes ``bench/results/moe_step.json``.
On a busy 2-core CPU machine the numbers say more about dispatch overhead than about
arithmetic: expert loops, permutations and all-to-alls are many small operations.

    python bench/moe_step.py --overlap [--ep 2 4] [--rounds 5] [--iters 2] [--warmup 1]
                             [--dispatchers allgather alltoall] [--out PATH]

The EP-overlap part: the expert-parallel communication modes at EP 2 and EP 4 (world = EP,
so data parallel = EP, expert data parallel 1), each rank a gloo process with one intra-op
thread, trained in-process through the training entry point
(:func:`megazero.testing.training_runs.train_in_rank`) inside
:func:`megazero.tensor_parallel.overlap.recording`: the allgather dispatcher plain, and the
alltoall dispatcher plain (every all-to-all waited for at once), with
``--moe-shared-expert-overlap`` (the shared expert under the forward dispatch) and with
``--overlap-moe-expert-parallel-comm`` (combined 1F1B: F0, (F1 B0), (F2 B1), (F3 B2), B3, each
paired all-to-all in flight while the other micro-batch computes). Default model: 4 layers,
hidden 256, seq 256, 8 experts top-2 of width 512, a shared expert of 512, SwiGLU, no biases,
fp32, 4 micro-batches of 4 sequences per rank a step, mock data.

A round trains each mode once (modes interleaved, so each round sees the same load), a fresh
run of ``--warmup`` + ``--iters`` iterations; the warm-up iterations are dropped. Each timed
iteration is one sample: its step time is the loop's ``train_step`` call on that rank, its
exposed EP communication the sum, over the traced all-to-alls issued in that step, of
``(completed - issued) x (1 - hidden share)`` (``OverlapTrace.hidden_shares``: the share of
its time in flight during which this rank computed; for a combined 1F1B pair that is the
other micro-batch's turn), its exposed share that over the step time; both are the ranks'
means. Reported: median [min, max] over the ``rounds x iters`` samples, the exposed share also
relative to the plain alltoall mode at the same EP. On a gloo CPU host an all-to-all's time
in flight includes the wait for the slowest peer, and the transfer itself uses the same cores
as the compute that "covers" it: a covered all-to-all is not free there. The allgather
dispatcher's all-gather / reduce-scatter are not traced, so its row gives step time only.
Writes ``bench/results/moe_step_overlap.json`` with the host's load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.testing import run_distributed  # noqa: E402
from megazero.testing.launch import check, read_metrics, run_training  # noqa: E402


def _base(a: argparse.Namespace) -> list[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--num-layers", "4", "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq), "--micro-batch-size", "4", "--global-batch-size", "8",
            "--lr", "1e-3", "--train-iters", str(a.iters), "--log-interval", "1",
            "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--swiglu", "--distributed-backend", "gloo"]


def _cases(a: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    f = a.expert_ffn
    dense = ["--ffn-hidden-size", str(a.topk * f)]
    moe = ["--num-experts", str(a.experts), "--moe-router-topk", str(a.topk),
           "--moe-ffn-hidden-size", str(f), "--moe-aux-loss-coeff", "1e-2"]
    out = [("dense", 1, dense), ("moe loop", 1, moe),
           ("moe grouped", 1, [*moe, "--moe-grouped-gemm"]), ("dense dp2", 2, dense)]
    for disp in ("allgather", "alltoall"):
        for grouped in (False, True):
            out.append((f"moe ep2 {disp}{' grouped' if grouped else ''}", 2,
                        [*moe, "--expert-model-parallel-size", "2",
                         "--moe-token-dispatcher-type", disp,
                         *(["--moe-grouped-gemm"] if grouped else [])]))
    for grouped in (False, True):  # every expert split in two instead (expert tensor parallel)
        out.append((f"moe etp2{' grouped' if grouped else ''}", 2,
                    [*moe, "--expert-tensor-parallel-size", "2",
                     *(["--moe-grouped-gemm"] if grouped else [])]))
    return out


# --- the EP-overlap part (--overlap) ---------------------------------------------------------

#: (dispatcher, mode, flags): the EP communication modes compared at each EP size
OVERLAP_MODES = [
    ("allgather", "plain", []),
    ("alltoall", "plain", []),
    ("alltoall", "shared-expert overlap", ["--moe-shared-expert-overlap"]),
    ("alltoall", "combined 1F1B", ["--overlap-moe-expert-parallel-comm"]),
]
MICRO_BATCHES = 4  # per step per data-parallel rank (combined 1F1B pairs F(k+1) with B(k))


def overlap_args(a: argparse.Namespace, world: int, iters: int, dispatcher: str,
                 flags: list[str]) -> list[str]:
    """The training arguments of one EP-overlap run: EP = world (so data parallel = world
    too, expert data parallel 1), :data:`MICRO_BATCHES` micro-batches of 4 per rank a step."""
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", "4", "--seq-length", str(a.seq),
            "--micro-batch-size", "4", "--global-batch-size", str(4 * MICRO_BATCHES * world),
            "--lr", "1e-3", "--train-iters", str(iters), "--log-interval", "1000",
            "--eval-interval", "1000", "--eval-iters", "0", "--seed", "7",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--swiglu",
            "--disable-bias-linear", "--num-experts", str(a.experts),
            "--moe-router-topk", str(a.topk), "--moe-ffn-hidden-size", str(a.expert_ffn),
            "--moe-shared-expert-intermediate-size", str(a.shared_ffn),
            "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", str(world),
            "--moe-token-dispatcher-type", dispatcher, *flags]


def overlap_rank(rank: int, world: int, runs: list[tuple[str, list[str]]], rounds: int,
                 warmup: int) -> dict[str, list[dict[str, float]]]:
    """Per mode, per timed iteration of this rank (``warmup`` first iterations of each run
    dropped): the step's seconds (``train_step``), the seconds of the traced EP collectives
    it issued (``comm_s``) and of those not covered by compute (``exposed_s``). Each round
    trains every mode once, through the training entry point, modes interleaved so that each
    round sees the same load."""
    import contextlib
    import io

    import megazero.training.loop as loop
    from megazero.tensor_parallel.overlap import recording
    from megazero.testing.training_runs import train_in_rank

    windows: list[tuple[float, float]] = []
    step = loop.train_step

    def timed_step(*args, **kwargs):  # the loop's own step, its window kept
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        windows.append((t0, time.perf_counter()))
        return out

    loop.train_step = timed_step
    out: dict[str, list[dict[str, float]]] = {name: [] for name, _ in runs}
    for _ in range(rounds):
        for name, args in runs:
            windows.clear()
            with contextlib.redirect_stdout(io.StringIO()), recording() as trace:
                train_in_rank(rank, world, args)
            comms = [(t0, t1, share) for (_, t0, t1), (_, share)
                     in zip(trace.comms, trace.hidden_shares())]
            for s0, s1 in windows[warmup:]:
                mine = [(t1 - t0, share) for t0, t1, share in comms if s0 <= t0 <= s1]
                out[name].append({"step_s": s1 - s0, "comm_s": sum(d for d, _ in mine),
                                  "exposed_s": sum(d * (1.0 - s) for d, s in mine),
                                  "comms": len(mine)})
    return out


def _spread(values: list[float], scale: float = 1.0) -> dict[str, float]:
    return {"median": scale * statistics.median(values), "min": scale * min(values),
            "max": scale * max(values)}


def overlap_main(a: argparse.Namespace) -> None:
    """Step time and exposed EP-communication share per mode at each EP size (see the module
    docstring); prints a table, writes ``--out``."""
    modes = [m for m in OVERLAP_MODES if m[0] in a.dispatchers]
    config = {k: getattr(a, k) for k in ("ep", "dispatchers", "rounds", "iters", "warmup",
                                         "layers", "hidden", "seq", "experts", "topk",
                                         "expert_ffn", "shared_ffn")}
    config.update(micro_batch_size=4, micro_batches_per_step=MICRO_BATCHES, precision="fp32",
                  backend="gloo", cpus=os.cpu_count())
    rows, loads = [], {"start": os.getloadavg()}
    for ep in a.ep:
        runs = [(f"{d} {m}", overlap_args(a, ep, a.warmup + a.iters, d, f))
                for d, m, f in modes]
        t0 = time.perf_counter()
        per_rank = run_distributed(overlap_rank, ep, runs, a.rounds, a.warmup, timeout=3600)
        loads[f"ep{ep}"] = os.getloadavg()  # (1, 5, 15 min) when this EP size is done
        for (dispatcher, mode, _), (name, _) in zip(modes, runs):
            n = len(per_rank[0][name])  # per timed iteration: the ranks' mean
            mean = {k: [statistics.mean(r[name][i][k] for r in per_rank) for i in range(n)]
                    for k in ("step_s", "comm_s", "exposed_s")}
            row = {"ep": ep, "dispatcher": dispatcher, "mode": mode, "n": n,
                   "step_ms": _spread(mean["step_s"], 1e3)}
            if dispatcher == "allgather":  # its all-gather / reduce-scatter are not traced
                row.update(comm_ms=None, exposed_ms=None, exposed_share=None,
                           note="the allgather dispatcher's collectives are not traced: "
                                "step time only")
            else:
                shares = [e / s for e, s in zip(mean["exposed_s"], mean["step_s"])]
                row.update(comm_ms=_spread(mean["comm_s"], 1e3),
                           exposed_ms=_spread(mean["exposed_s"], 1e3),
                           exposed_share=_spread(shares),
                           comms_per_step=per_rank[0][name][0]["comms"])
            rows.append(row)
        print(f"ep {ep}: {time.perf_counter() - t0:.0f} s, load average "
              f"{' '.join(f'{x:.2f}' for x in loads[f'ep{ep}'])}", flush=True)
    _overlap_table(a, rows)
    out = {"config": config, "load_average": loads, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {a.out}")


def _overlap_table(a: argparse.Namespace, rows: list[dict]) -> None:
    print(f"\nEP communication overlap, {a.layers} layers, h={a.hidden} s={a.seq} "
          f"E={a.experts} k={a.topk} expert ffn {a.expert_ffn} shared {a.shared_ffn}, "
          f"{MICRO_BATCHES} micro-batches of 4 a step, fp32, gloo CPU; medians [min, max] "
          f"over {a.rounds} rounds x {a.iters} iterations")
    print(f"{'ep':>2} {'dispatcher':<10} {'mode':<22} {'step ms':>24} {'a2a ms':>7} "
          f"{'exposed ms':>10} {'exposed share':>24} {'x plain':>7}")
    plain = {r["ep"]: r["exposed_share"]["median"] for r in rows
             if r["dispatcher"] == "alltoall" and r["mode"] == "plain"}
    for r in rows:
        s = r["step_ms"]
        line = (f"{r['ep']:>2} {r['dispatcher']:<10} {r['mode']:<22} {s['median']:>8.0f} "
                f"[{s['min']:>6.0f}, {s['max']:>6.0f}]")
        if r["exposed_share"] is None:
            print(f"{line} {'-':>7} {'-':>10} {'- (not traced)':>24} {'-':>7}")
            continue
        e = r["exposed_share"]
        r["exposed_share_vs_plain"] = (e["median"] / plain[r["ep"]] if r["ep"] in plain
                                       else None)
        rel = r["exposed_share_vs_plain"]
        print(f"{line} {r['comm_ms']['median']:>7.0f} {r['exposed_ms']['median']:>10.0f} "
              f"{e['median']:>8.3f} [{e['min']:.3f}, {e['max']:.3f}] "
              f"{'-' if rel is None else f'x{rel:.2f}':>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--overlap", action="store_true",
                    help="the EP-overlap part instead of the dense/MoE ratios")
    # defaults: dense/MoE part, then --overlap part
    ap.add_argument("--iters", type=int, help="12; --overlap: timed iterations per run, 2")
    ap.add_argument("--hidden", type=int, help="128; --overlap: 256")
    ap.add_argument("--seq", type=int, help="128; --overlap: 256")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, help="256; --overlap: 512")
    ov = ap.add_argument_group("--overlap only")
    ov.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    ov.add_argument("--dispatchers", nargs="+", default=["allgather", "alltoall"],
                    choices=["allgather", "alltoall"])
    ov.add_argument("--rounds", type=int, default=5)
    ov.add_argument("--warmup", type=int, default=1, help="iterations dropped per run")
    ov.add_argument("--layers", type=int, default=4)
    ov.add_argument("--shared-ffn", type=int, default=512)
    ov.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "moe_step_overlap.json"))
    a = ap.parse_args()
    for key, dense_part, overlap_part in (("iters", 12, 2), ("hidden", 128, 256),
                                          ("seq", 128, 256), ("expert_ffn", 256, 512)):
        if getattr(a, key) is None:
            setattr(a, key, overlap_part if a.overlap else dense_part)
    if a.overlap:
        overlap_main(a)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, flags in _cases(a):
            log = os.path.join(tmp, f"{len(rows)}.jsonl")
            check(run_training([*_base(a), *flags, "--log-json", log], nproc=nproc,
                               timeout=900))
            times = [m["iteration-time"] * 1000 for it, m in sorted(read_metrics(log).items())
                     if it > 2]
            rows.append({"case": name, "processes": nproc, "median_ms": statistics.median(times),
                         "min_ms": min(times), "max_ms": max(times), "n": len(times)})
    dense = {r["processes"]: r["median_ms"] for r in rows if r["case"].startswith("dense")}
    print(f"\nMoE step time, h={a.hidden} s={a.seq} E={a.experts} k={a.topk} expert ffn "
          f"{a.expert_ffn} (dense ffn {a.topk * a.expert_ffn}), 4 layers, fp32, gloo CPU")
    print(f"{'case':<28} {'procs':>5} {'median ms':>10} {'min-max ms':>16} {'x dense':>8}")
    for r in rows:
        r["vs_dense"] = r["median_ms"] / dense[r["processes"]]
        print(f"{r['case']:<28} {r['processes']:>5} {r['median_ms']:>10.1f} "
              f"{r['min_ms']:>7.1f}-{r['max_ms']:<8.1f} {r['vs_dense']:>8.2f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe_step.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        config = {k: getattr(a, k) for k in ("iters", "hidden", "seq", "experts", "topk",
                                             "expert_ffn")}
        json.dump({"config": config, "load_average": os.getloadavg(), "rows": rows}, fh,
                  indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
