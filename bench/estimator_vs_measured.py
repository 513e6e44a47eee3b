"""Predicted vs measured step time of one small GPT in several layouts on this CPU.

Each layout runs through pretrain_gpt.py with torchrun (gloo, mock data, a few iterations; the
median iteration time after the first is the measurement, see megazero/planner/measure.py).
The prediction is megazero.planner.estimate with the ``cpu`` cluster description
(megazero/planner/clusters/cpu.json). Prints a table and the Spearman rank correlation, and
writes bench/results/estimator_vs_measured.json.

    PYTHONPATH=$PWD python bench/estimator_vs_measured.py [--iters 4]

``--memory``: instead of time, the peak memory per rank of each layout (two iterations through
the pipeline executor, gradient sync and optimizer step, in one spawned world) against the
planner's device total, and the executor's peak saved activation bytes against the planner's
schedule walk (megazero/planner/validate.py). On a machine with CUDA the ranks use NCCL and the
measure is ``torch.cuda.max_memory_allocated()``; on CPU, gloo and the live bytes of every
tensor storage. Writes bench/results/estimator_vs_measured_memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megazero.planner.cluster import load_cluster  # noqa: E402
from megazero.planner.measure import measure_flags  # noqa: E402
from megazero.planner.search import _config  # noqa: E402

BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
        "--vocab-size 1024 --tokenizer-type NullTokenizer --global-batch-size 16").split()
WORLD = 2
LAYOUTS = [  # (name, flags)
    ("dp2 z0 mbs4", ["--zero-stage=0", "--micro-batch-size=4"]),
    ("dp2 z1 mbs4", ["--zero-stage=1", "--micro-batch-size=4"]),
    ("dp2 z3 mbs4", ["--zero-stage=3", "--micro-batch-size=4"]),
    ("dp2 z2 offload mbs4", ["--zero-stage=2", "--micro-batch-size=4", "--offload-optimizer"]),
    ("dp2 z1 full recompute mbs4", ["--zero-stage=1", "--micro-batch-size=4",
                                    "--recompute-granularity=full", "--recompute-method=uniform",
                                    "--recompute-num-layers=1"]),
    ("tp2 mbs4", ["--tensor-model-parallel-size=2", "--micro-batch-size=4"]),
    ("tp2 sp mbs4", ["--tensor-model-parallel-size=2", "--sequence-parallel",
                     "--micro-batch-size=4"]),
    ("pp2 mbs2", ["--pipeline-model-parallel-size=2", "--micro-batch-size=2"]),
    ("pp2 mbs1", ["--pipeline-model-parallel-size=2", "--micro-batch-size=1"]),
]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):  # ties share their average rank
        return [sum(1 for y in x if y < v) + (sum(1 for y in x if y == v) - 1) / 2 for v in x]

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb)


def memory(iters: int) -> None:
    import torch

    from megazero.planner.validate import measure_layouts
    from megazero.testing import run_distributed

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
    layouts = [(n, f) for n, f in LAYOUTS if "--offload-optimizer" not in f]
    names = [n for n, _ in layouts]
    out = run_distributed(measure_layouts, WORLD, [["--mock-data", *BASE, *f] for _, f in layouts],
                          iters=iters, backend="nccl" if cuda else "gloo", timeout=1800)
    rows = []
    print(f"{'layout':<30}{'rank':>5}{'measured':>12}{'predicted':>12}{'ratio':>8}"
          f"{'saved act.':>12}{'predicted':>12}{'ratio':>8}")
    for rank_rows in out:
        for name, r in zip(names, rank_rows):
            r["layout"] = name
            rows.append(r)
            print(f"{name:<30}{r['rank']:>5}{r['measured_peak']:>12.0f}"
                  f"{r['predicted_peak']:>12.0f}{r['measured_peak'] / r['predicted_peak']:>8.3f}"
                  f"{r['measured_saved']:>12.0f}{r['predicted_saved']:>12.0f}"
                  f"{r['measured_saved'] / r['predicted_saved']:>8.3f}")
    worst = max(abs(r["measured_peak"] / r["predicted_peak"] - 1) for r in rows)
    print(f"largest peak-memory error: {worst:.1%} ({'cuda' if cuda else 'cpu'})")
    path = Path(__file__).parent / "results" / "estimator_vs_measured_memory.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"base": BASE, "world": WORLD, "device": "cuda" if cuda else "cpu",
                                "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--memory", action="store_true",
                    help="peak memory per rank instead of step time")
    args = ap.parse_args()
    if args.memory:
        memory(max(2, min(args.iters, 3)))
        return
    cluster = load_cluster("cpu")
    rows = []
    for name, flags in LAYOUTS:
        from megazero.planner.estimate import estimate

        est = estimate(_config(BASE, flags, WORLD), cluster)
        measured, err = measure_flags(BASE + flags, WORLD, args.iters)
        rows.append(dict(layout=name, flags=flags, predicted_s=est.time.seconds,
                         terms=est.time.terms, measured_s=measured, error=err))
        print(f"{name:<30} predicted {est.time.seconds:8.4f} s   measured "
              f"{'-' if measured is None else f'{measured:.4f}'} s  {err or ''}", flush=True)
    ok = [r for r in rows if r["measured_s"] is not None]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    print(f"Spearman rank correlation over {len(ok)} layouts: {rho:.3f}")
    out = Path(__file__).parent / "results" / "estimator_vs_measured.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"base": BASE, "world": WORLD, "cluster": cluster.__dict__,
                               "rows": rows, "spearman": rho}, indent=1) + "\n")


if __name__ == "__main__":
    main()
