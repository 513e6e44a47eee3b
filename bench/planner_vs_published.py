"""Predicted vs published iteration time for Megatron-LM's 2021 Table 1 (1.7B to 1T on A100s).

Each row runs through the planner as the paper ran it (megazero/planner/published.py: its
layout, micro-batch, interleaving, full recompute, fp16, scatter/gather p2p, DDP overlap) on
one cluster description (default ``a100-80gb``, every number with its source in the file);
the published time is the paper's FLOP count over its TFLOP/s per GPU. Prints the table with
each row's time terms, the ratio's median and range, and the range of the cluster's
``achievable_fraction`` (its one assumed number) over which every row stays within 15%.
Writes bench/results/planner_vs_published.json. A model, no timing: it runs in seconds.

    PYTHONPATH=$PWD python bench/planner_vs_published.py [--cluster a100-80gb] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megazero.planner.cluster import Cluster, load_cluster  # noqa: E402
from megazero.planner.published import TABLE1, predict  # noqa: E402

TOLERANCE = 0.15


def ratios(cluster: Cluster) -> list[float]:
    return [predict(r, cluster).time.seconds / r.published_seconds for r in TABLE1]


def fraction_range(cluster: Cluster) -> tuple[float, float] | None:
    """The ``achievable_fraction`` values (steps of 0.01) keeping every row within 15%."""
    ok = [f / 100 for f in range(30, 101)
          if all(abs(x - 1) <= TOLERANCE for x in ratios(
              dataclasses.replace(cluster, achievable_fraction=f / 100)))]
    return (min(ok), max(ok)) if ok else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="a100-80gb")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"
                                         / "planner_vs_published.json"))
    args = ap.parse_args(argv)
    cluster = load_cluster(args.cluster)
    rows = []
    print(f"cluster {cluster.name}: {cluster.device}; achievable_fraction "
          f"{cluster.achievable_fraction}, HBM {cluster.hbm_gbps:g} GB/s")
    print(f"{'model':>7} {'GPUs':>5} {'tp':>2} {'pp':>2} {'v':>2} {'mbs':>3} {'gbs':>5} "
          f"{'TFLOP/s':>7} {'published s':>11} {'predicted s':>11} {'ratio':>6}  terms (s)")
    for r in TABLE1:
        est = predict(r, cluster)
        t = est.time
        ratio = t.seconds / r.published_seconds
        v = r.layers // r.pp // r.layers_per_virtual_stage if r.layers_per_virtual_stage else 1
        terms = ", ".join(f"{k} {x:.2f}" for k, x in t.terms.items() if x >= 0.005)
        print(f"{r.name:>7} {r.gpus:>5} {r.tp:>2} {r.pp:>2} {v:>2} {r.micro_batch:>3} "
              f"{r.global_batch:>5} {r.tflops_per_gpu:>7g} {r.published_seconds:>11.2f} "
              f"{t.seconds:>11.2f} {ratio:>6.3f}  {terms}")
        rows.append(dict(model=r.name, gpus=r.gpus, tp=r.tp, pp=r.pp, virtual_stages=v,
                         micro_batch=r.micro_batch, global_batch=r.global_batch,
                         overlap_dp=r.overlap_dp, published_tflops_per_gpu=r.tflops_per_gpu,
                         published_s=r.published_seconds, predicted_s=t.seconds, ratio=ratio,
                         predicted_tflops_per_gpu=r.flops_per_iteration
                         / (t.seconds * r.gpus) / 1e12,
                         fits=est.fits, device_gb=est.worst.device_total / 1e9,
                         terms_s=t.terms))
    rs = [x["ratio"] for x in rows]
    span = fraction_range(cluster)
    worst = max(rs, key=lambda x: abs(x - 1))
    print(f"predicted / published: median {statistics.median(rs):.3f}, range "
          f"{min(rs):.3f}-{max(rs):.3f}, worst {abs(worst - 1):.1%} off; every row within "
          f"{TOLERANCE:.0%}: {all(abs(x - 1) <= TOLERANCE for x in rs)}")
    print("achievable_fraction keeping every row within 15%: "
          + (f"{span[0]:.2f}-{span[1]:.2f}" if span else "none"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        source="Narayanan et al. 2021 (arXiv 2104.04473) Table 1; settings of "
               "examples/sc21/run_table_1.sh", cluster=dataclasses.asdict(cluster),
        rows=rows, ratio_median=statistics.median(rs), ratio_min=min(rs), ratio_max=max(rs),
        achievable_fraction_within_15pct=span), indent=1) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
