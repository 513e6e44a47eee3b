"""Context parallelism on this machine: activation bytes per rank and step time, CP 1 / 2 / 4.

    python bench/context_parallel.py [--seq 1024] [--hidden 128] [--heads 8] [--layers 2]
                                     [--batch 1] [--repeats 5]

A GPT of ``--layers`` layers (fp32, SDPA core attention at CP 1, dropout 0) on a world of 4
gloo ranks, the same batch at every CP size (:mod:`megazero.testing.context_parallel_memory`):
the bytes one micro-batch's forward keeps for backward on a rank, as the pipeline's activation
meter counts them, the planner's prediction of them, and the median forward+backward seconds
of one micro-batch on a rank (with the min-max spread over ``--repeats``), for each
``--cp-comm-type``. Every case keeps all 4 ranks busy (CP 1: four independent ranks; CP 2:
two groups), so the ranks share the machine's cores alike in every row. Prints the table and
writes ``bench/results/context_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.testing import run_distributed  # noqa: E402
from megazero.testing.context_parallel_memory import measure_cp_sizes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
             "--max-position-embeddings", str(args.seq), "--micro-batch-size", str(args.batch),
             "--global-batch-size", str(4 * args.batch), "--vocab-size", "512",
             "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--lr", "1e-3", "--train-iters", "1"]
    rows = []
    print(f"s={args.seq} h={args.hidden} a={args.heads} layers={args.layers} b={args.batch}, "
          f"fp32, 4 gloo ranks on {os.cpu_count()} cores")
    print(f"{'comm':<11} {'cp':>2} {'saved MB':>9} {'vs cp1':>7} {'planner':>8} "
          f"{'step ms':>8} {'spread ms':>13} {'vs cp1':>7}")
    for comm in ("p2p", "all_gather", "a2a"):
        part = run_distributed(measure_cp_sizes, 4, flags, comm_type=comm,
                               repeats=args.repeats, timeout=600)[0]
        base = part[0]
        base_t = statistics.median(base["seconds"])
        for r in part:
            t = statistics.median(r["seconds"])
            r.update(median_s=t, min_s=min(r["seconds"]), max_s=max(r["seconds"]),
                     bytes_vs_cp1=r["measured_bytes"] / base["measured_bytes"],
                     planner_vs_measured=r["predicted_bytes"] / r["measured_bytes"],
                     time_vs_cp1=t / base_t)
            print(f"{comm:<11} {r['cp']:>2} {r['measured_bytes'] / 1e6:>9.2f} "
                  f"{r['bytes_vs_cp1']:>7.3f} {r['planner_vs_measured']:>8.3f} "
                  f"{t * 1e3:>8.1f} {r['min_s'] * 1e3:>6.1f}-{r['max_s'] * 1e3:<6.1f} "
                  f"{r['time_vs_cp1']:>7.2f}")
        rows += part
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "context_parallel.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"config": vars(args), "cores": os.cpu_count(), "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
