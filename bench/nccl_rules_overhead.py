"""What the NCCL-rules test mode (megazero/testing/nccl_rules.py) adds to one collective call.

The mode wraps every torch.distributed call: it binds the arguments, asks whether each tensor is
host-resident, writes and flushes one log line, and times the call. This measures that cost per
call where it is largest relative to the collective: a 1-element all-reduce and a 4096-element
all-gather on a world of 2 gloo ranks, mode off and on, ``--calls`` calls per sample, ``--samples``
samples alternating off/on (a shared machine's load drifts; alternating keeps both sides in the
same minutes). Reported: median [min-max] microseconds per call of rank 0, and the difference of
the medians. The suites that run under the mode issue a few thousand collectives per world, so
the difference times that count bounds what the mode adds to a test.

    python bench/nccl_rules_overhead.py [--calls 2000] [--samples 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPS = ("all_reduce[1]", "all_gather_into_tensor[4096]")


def _world(rank: int, world: int, calls: int, samples: int) -> dict[str, dict[str, list[float]]]:
    import tempfile

    import torch
    import torch.distributed as dist

    from megazero.testing import nccl_rules

    one = torch.zeros(1)
    shard, full = torch.zeros(4096), torch.zeros(4096 * world)
    logs = tempfile.mkdtemp(prefix="nccl-rules-bench-")
    out: dict[str, dict[str, list[float]]] = {op: {"off": [], "on": []} for op in OPS}
    for _ in range(samples):
        for mode in ("off", "on"):
            if mode == "on":
                nccl_rules.install(rank, logs)
            for op in OPS:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    if op == OPS[0]:
                        dist.all_reduce(one)
                    else:
                        dist.all_gather_into_tensor(full, shard)
                out[op][mode].append((time.perf_counter() - t0) / calls * 1e6)
            if mode == "on":
                nccl_rules.uninstall()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--samples", type=int, default=7)
    args = p.parse_args()
    from megazero.testing import run_distributed

    res = run_distributed(_world, 2, args.calls, args.samples, timeout=1800, nccl_rules=False)[0]
    rows = {}
    print(f"{'op (2 gloo ranks)':32} {'off us/call':>22} {'on us/call':>22} {'added':>8}")
    for op in OPS:
        off, on = res[op]["off"], res[op]["on"]
        row = {"off_median": statistics.median(off), "off_min": min(off), "off_max": max(off),
               "on_median": statistics.median(on), "on_min": min(on), "on_max": max(on)}
        row["added_us"] = row["on_median"] - row["off_median"]
        rows[op] = row
        print(f"{op:32} {row['off_median']:8.1f} [{row['off_min']:.1f}-{row['off_max']:.1f}]"
              f"{'':>2} {row['on_median']:8.1f} [{row['on_min']:.1f}-{row['on_max']:.1f}]"
              f"{'':>2} {row['added_us']:8.1f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "nccl_rules_overhead.json")
    with open(path, "w") as f:
        json.dump({"calls_per_sample": args.calls, "samples": args.samples, "ops": rows,
                   "load_average": os.getloadavg()}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
