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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=256)
    a = ap.parse_args()
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
        json.dump({"config": vars(a), "load_average": os.getloadavg(), "rows": rows}, fh,
                  indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
