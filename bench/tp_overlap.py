"""Sequence-parallel collectives inside the GEMMs (--tp-comm-overlap) on gloo: step time and
exposed TP-communication share per mode.

    python bench/tp_overlap.py [--tp 2 4] [--seq 1024] [--hidden 512] [--ffn 4096]
                               [--layers 2] [--rounds 7]

A stack of MLP blocks (column-parallel, GELU, row-parallel) with sequence parallelism, forward
and backward, on ``--tp`` gloo ranks (one thread each), modes interleaved round by round (see
:mod:`megazero.testing.tp_overlap_bench` for what "exposed" counts). Prints a table and writes
``bench/results/tp_overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.testing import run_distributed  # noqa: E402
from megazero.testing.tp_overlap_bench import bench_rank, summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    results = {}
    for tp in args.tp:
        per_rank = run_distributed(bench_rank, tp, args.seq, args.hidden, args.ffn, args.layers,
                                   args.rounds, timeout=1200)
        results[f"tp{tp}"] = summary = summarize(per_rank)
        print(f"\ntp {tp} + SP, seq {args.seq}, hidden {args.hidden}, ffn {args.ffn}, "
              f"{args.layers} layers, {args.rounds} rounds (medians, [min, max])")
        print(f"{'mode':<18} {'step ms':>22} {'exposed ms':>11} {'exposed share':>26}")
        plain = summary["plain"]["exposed_share_median"]
        for name, r in summary.items():
            print(f"{name:<18} {r['step_ms_median']:>8.1f} [{r['step_ms_min']:.1f}, "
                  f"{r['step_ms_max']:.1f}] {r['exposed_ms_median']:>11.1f} "
                  f"{r['exposed_share_median']:>8.3f} [{r['exposed_share_min']:.3f}, "
                  f"{r['exposed_share_max']:.3f}]  x{r['exposed_share_median'] / plain:.2f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tp_overlap.json")
    with open(out, "w") as f:
        json.dump({"config": vars(args), "backend": "gloo", "cpus": os.cpu_count(),
                   # the host's load (1, 5, 15 min) when done: the shares move with it
                   "load_average": os.getloadavg(), "results": results}, f, indent=2)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
