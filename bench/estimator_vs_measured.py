"""Predicted vs measured step time of one small GPT in several layouts on this CPU.

Each layout runs through pretrain_gpt.py with torchrun (gloo, mock data, ``--iters``
iterations; the first ``--warmup`` are not kept). The 2 cores are shared with other work, so
every layout runs once per round, ``--rounds`` rounds, in an order rotated (and reversed every
other round) from round to round; a layout's measurement is the median of its per-round
medians, its spread the range of those and the inter-quartile range of its iterations; the
1-minute load average is recorded before each trial, and the ranking is also compared inside
each round alone. The prediction is megazero.planner.estimate with the ``cpu`` cluster
description (megazero/planner/clusters/cpu.json, calibrated by bench/cpu_calibration.py on
micro-benchmarks, none of them these layouts). Prints a table and the Spearman rank
correlation, and writes bench/results/estimator_vs_measured.json; ``--reuse`` predicts again
against the measurements stored there.

    PYTHONPATH=$PWD python bench/estimator_vs_measured.py [--rounds 3 --iters 6 --warmup 2]
        [--set calibration|holdout] [--list]

``--set holdout`` measures layouts of another model chosen by a rule on predictions alone (see
``holdout_layouts``), fixed before they were measured: the out-of-sample check of the ranking,
written to bench/results/estimator_vs_measured_holdout.json.

``--memory``: instead of time, the peak memory per rank of each layout (two iterations through
the pipeline executor, gradient sync and optimizer step, in one spawned world) against the
planner's device total, and the executor's peak saved activation bytes against the planner's
schedule walk (megazero/testing/planner_validate.py). On a machine with CUDA the ranks use NCCL and
the measure is ``torch.cuda.max_memory_allocated()``; on CPU, gloo and the live bytes of every
tensor storage. Writes bench/results/estimator_vs_measured_memory.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megazero.planner.cluster import load_cluster  # noqa: E402
from megazero.planner.measure import measure_times  # noqa: E402
from megazero.planner.search import _config  # noqa: E402

BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
        "--vocab-size 1024 --tokenizer-type NullTokenizer --global-batch-size 16").split()
WORLD = 2
RECOMPUTE = ["--recompute-granularity=full", "--recompute-method=uniform",
             "--recompute-num-layers=1"]
LAYOUTS = [  # (name, flags): pipeline bubbles, TP collectives, ZeRO stages, recompute
    ("dp2 z0 mbs8", ["--zero-stage=0", "--micro-batch-size=8"]),
    ("tp2 mbs8", ["--tensor-model-parallel-size=2", "--micro-batch-size=8"]),
    ("dp2 z1 mbs1", ["--zero-stage=1", "--micro-batch-size=1"]),
    ("dp2 z1 mbs8 full recompute", ["--zero-stage=1", "--micro-batch-size=8", *RECOMPUTE]),
    ("tp2 sp mbs1", ["--tensor-model-parallel-size=2", "--sequence-parallel",
                     "--micro-batch-size=1"]),
    ("dp2 z3 mbs1", ["--zero-stage=3", "--micro-batch-size=1"]),
    ("pp2 mbs8", ["--pipeline-model-parallel-size=2", "--micro-batch-size=8"]),
    ("pp2 mbs1 full recompute", ["--pipeline-model-parallel-size=2", "--micro-batch-size=1",
                                 *RECOMPUTE]),
    ("pp2 mbs16", ["--pipeline-model-parallel-size=2", "--micro-batch-size=16"]),
]

# The hold-out set (``--set holdout``): another model, and layouts chosen by a rule that reads
# only predictions, fixed before any of them was measured. Every layout the planner enumerates
# for this model at world 2 (offload left out: on the CPU it moves nothing) is predicted; the
# rule takes HOLDOUT_COUNT of them at log-evenly spaced predicted times between the fastest and
# the slowest (the nearest not yet taken to each target), so that the ranking is asked of
# layouts whose predictions differ by more than the machine's noise.
HOLDOUT_BASE = ("--num-layers 6 --hidden-size 192 --num-attention-heads 6 --seq-length 256 "
                "--vocab-size 2048 --tokenizer-type NullTokenizer --global-batch-size 8").split()
HOLDOUT_COUNT = 8


def holdout_layouts(cluster) -> list[tuple[str, list[str]]]:
    """The hold-out rule above: ``(label, flags)`` fastest first."""
    from megazero.planner.search import search

    gbs = int(HOLDOUT_BASE[HOLDOUT_BASE.index("--global-batch-size") + 1])
    fits = search(HOLDOUT_BASE, WORLD, cluster, gbs, keep=10**9).fits  # every layout that fits
    cands = [c for c in fits if "--offload-optimizer" not in c.flags]
    t = [c.est.time.seconds for c in cands]
    lo, hi = t[0], t[-1]
    taken: list[int] = []
    for i in range(HOLDOUT_COUNT):
        target = lo * (hi / lo) ** (i / (HOLDOUT_COUNT - 1))
        k = min((j for j in range(len(cands)) if j not in taken),
                key=lambda j: abs(math.log(t[j] / target)))
        taken.append(k)
    return [(cands[k].label, [f for f in cands[k].flags if not f.startswith(
        "--global-batch-size")]) for k in sorted(taken)]


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

    from megazero.testing import run_distributed
    from megazero.testing.planner_validate import measure_layouts

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


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def measure_rounds(layouts: list[tuple[str, list[str]]], base: list[str], rounds: int,
                   iters: int, warmup: int, raw: Path, out: dict[str, dict] | None = None
                   ) -> dict[str, dict]:
    """Every layout once per round, in a rotated order (each layout runs at a different position
    of each round, so slow phases of the shared machine fall on different layouts); per layout,
    the per-iteration times after ``warmup`` iterations of every round, each round's median and
    the 1-minute load average before each trial."""
    out = out or {n: {"times": [], "round_medians": [], "round_ids": [], "load": [],
                      "error": None} for n, _ in layouts}
    first = 1 + max((i for v in out.values() for i in v["round_ids"]), default=-1)
    for r in range(first, first + rounds):
        order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]
        if r % 2:
            order = order[::-1]
        for name, flags in order:
            load = _loadavg()
            times, err = measure_times(base + flags, WORLD, iters)
            row = out[name]
            row["load"].append(load)
            if times is None or len(times) <= warmup:
                row["error"] = err or "too few iterations"
                print(f"round {r} {name:<30} failed: {row['error']}", flush=True)
                continue
            kept = times[warmup:]
            row["times"].append(kept)
            row["round_medians"].append(statistics.median(kept))
            row["round_ids"].append(r)
            print(f"round {r} {name:<30} median {statistics.median(kept):.4f} s "
                  f"(min {min(kept):.4f} max {max(kept):.4f}) load {load:.2f}", flush=True)
            raw.write_text(json.dumps(out))  # every trial so far, to resume or re-predict
    return out


def summarise(measured: dict[str, dict]) -> dict[str, dict]:
    """The median of the per-round medians; spread as their range and the inter-quartile range
    of the kept iterations."""
    for row in measured.values():
        flat = sorted(t for ts in row["times"] for t in ts)
        if not row["round_medians"]:
            row["median_s"] = None
            continue
        q = statistics.quantiles(flat, n=4) if len(flat) > 1 else (flat * 3 or [None] * 3)
        row["median_s"] = statistics.median(row["round_medians"])
        row["iqr_s"] = [q[0], q[2]]
        row["round_median_range_s"] = [min(row["round_medians"]), max(row["round_medians"])]
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=6, help="iterations per trial")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations of a trial not kept")
    ap.add_argument("--rounds", type=int, default=3, help="trials of every layout, interleaved")
    ap.add_argument("--cluster", default="cpu", help="cluster description for the prediction")
    ap.add_argument("--raw", default=None,
                    help="every trial's times, written after each trial")
    ap.add_argument("--resume", action="store_true",
                    help="add --rounds rounds to the trials already in --raw")
    ap.add_argument("--reuse", action="store_true",
                    help="predict again against the measurements already in the results JSON")
    ap.add_argument("--memory", action="store_true",
                    help="peak memory per rank instead of step time")
    ap.add_argument("--set", choices=("calibration", "holdout"), default="calibration",
                    help="the 9 layouts the step-time model was developed on, or the hold-out "
                         "set (another model; layouts chosen by a rule on predictions only)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default bench/results/estimator_vs_measured[_holdout]"
                         ".json; with --reuse nothing is written unless given)")
    ap.add_argument("--list", action="store_true",
                    help="print the set's layouts and predictions, measure nothing")
    args = ap.parse_args()
    if args.memory:
        memory(max(2, min(args.iters, 3)))
        return
    from megazero.planner.estimate import estimate

    cluster = load_cluster(args.cluster)
    suffix = "" if args.set == "calibration" else "_holdout"
    path = Path(__file__).parent / "results" / f"estimator_vs_measured{suffix}.json"
    old = json.loads(path.read_text()) if args.reuse else None
    if old is not None:  # the layouts measured then (a hold-out set is not chosen again)
        base, layouts = old["base"], [(r["layout"], r["flags"]) for r in old["rows"]]
    else:
        base, layouts = ((BASE, LAYOUTS) if args.set == "calibration"
                         else (HOLDOUT_BASE, holdout_layouts(cluster)))
    if args.list:
        for name, flags in layouts:
            est = estimate(_config(base, flags, WORLD), cluster)
            print(f"{name:<50}{est.time.seconds:>9.4f} s  {' '.join(flags)}")
        return
    if old is not None:
        measured = {r["layout"]: r["measured"] for r in old["rows"]}
        meta = old["measurement"]
    else:
        meta = {"rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
                "load_before": _loadavg()}
        raw = Path(args.raw or f"/tmp/estimator_vs_measured{suffix}_raw.json")
        prior = json.loads(raw.read_text()) if args.resume else None
        measured = summarise(measure_rounds(layouts, base, args.rounds, args.iters,
                                            args.warmup, raw, prior))
        meta["rounds"] = min(len(v["round_medians"]) for v in measured.values())
        meta["complete_rounds"] = sorted(set.intersection(
            *(set(v["round_ids"]) for v in measured.values())))
        meta["load_after"] = _loadavg()
    rows = []
    for name, flags in layouts:
        est = estimate(_config(base, flags, WORLD), cluster)
        m = measured[name]
        rows.append(dict(layout=name, flags=flags, predicted_s=est.time.seconds,
                         terms=est.time.terms, measured_s=m["median_s"], measured=m))
    w = max(30, 2 + max(len(n) for n, _ in layouts))
    print(f"{'layout':<{w}}{'predicted':>10}{'measured':>10}{'round medians':>22}{'ratio':>7}")
    for r in rows:
        m = r["measured"]
        if r["measured_s"] is None:
            print(f"{r['layout']:<{w}}{r['predicted_s']:>10.4f}{'-':>10}  {m['error']}")
            continue
        lo, hi = m["round_median_range_s"]
        print(f"{r['layout']:<{w}}{r['predicted_s']:>10.4f}{r['measured_s']:>10.4f}"
              f"{lo:>11.4f}-{hi:<10.4f}{r['measured_s'] / r['predicted_s']:>7.3f}")
    ok = [r for r in rows if r["measured_s"] is not None]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    # the same comparison inside each round: every layout's trial of that round
    ids = sorted(set.intersection(*(set(r["measured"]["round_ids"]) for r in ok)))
    per_round = [spearman([r["predicted_s"] for r in ok],
                          [r["measured"]["round_medians"][r["measured"]["round_ids"].index(k)]
                           for r in ok]) for k in ids]
    n_rounds = min(len(r["measured"]["round_ids"]) for r in ok)
    loads = [x for r in ok for x in r["measured"]["load"]]
    print(f"Spearman rank correlation over {len(ok)} layouts: {rho:.3f} (medians of "
          f"{n_rounds} interleaved rounds; per round: {', '.join(f'{x:.3f}' for x in per_round)}"
          f"); 1-min load average during trials {min(loads):.2f}-{max(loads):.2f}")
    path.parent.mkdir(exist_ok=True)
    if args.reuse and args.out is None:
        print(f"(--reuse: {path.name} left as measured and predicted then; --out to write)")
        return
    out_path = Path(args.out) if args.out else path
    out_path.write_text(json.dumps({"set": args.set, "base": base, "world": WORLD,
                                "cluster": cluster.__dict__,
                                "measurement": meta, "rows": rows, "spearman": rho,
                                "spearman_per_round": per_round}, indent=1) + "\n")


if __name__ == "__main__":
    main()
