"""Predicted vs published iteration time: Megatron-LM's 2021 Table 1 (1.7B to 1T on A100s) or
Megatron-Bridge's 25.11 DGX-H100 table (Llama-3 8B-405B in FP8, GPT-OSS 120B, Qwen3 MoE).

Each row runs through the planner as it was run (``megazero/planner/published.py``: the
paper's layout, micro-batch, interleaving, full recompute, fp16, scatter/gather p2p, DDP
overlap; ``megazero/planner/published_bridge.py``: the table's layout, the recipes' settings,
the features megazero lacks priced as the row uses them) on one cluster description (default
``a100-80gb`` / ``h100-80gb-nvlink``, every number with its source in the file); the published
time is the table's FLOP count over its TFLOP/s per GPU. Prints each row with its time terms,
the ratio's median and range, and, for each number the cluster assumes, the range over which
every row stays within its bound (15%; 20% for the MoE rows of the Bridge table). For the
Bridge table also the MoE rows' expert-parallel terms and a Mixtral 8x7B run on 64 H100s read
against them. Writes bench/results/planner_vs_published.json (or ..._bridge_h100.json). A
model, no timing: it runs in seconds (the ranges take a minute).

    PYTHONPATH=$PWD python bench/planner_vs_published.py [--table megatron-2021|bridge-h100]
        [--cluster NAME] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megazero.planner.cluster import Cluster, load_cluster  # noqa: E402
from megazero.planner.published import TABLE1, predict  # noqa: E402

TOLERANCE = 0.15
RESULTS = Path(__file__).parent / "results"
#: the numbers a cluster file assumes, and the grid each one's range is searched on
ASSUMED = {"achievable_fraction": [f / 100 for f in range(30, 101)],
           "achievable_fraction_fp8": [f / 100 for f in range(20, 101)],
           "expert_kernel_overhead_us": [float(u) for u in range(0, 301, 5)]}


def ratios(cluster: Cluster) -> list[float]:
    return [predict(r, cluster).time.seconds / r.published_seconds for r in TABLE1]


def fraction_range(cluster: Cluster) -> tuple[float, float] | None:
    """The ``achievable_fraction`` values (steps of 0.01) keeping every row within 15%."""
    ok = [f / 100 for f in range(30, 101)
          if all(abs(x - 1) <= TOLERANCE for x in ratios(
              dataclasses.replace(cluster, achievable_fraction=f / 100)))]
    return (min(ok), max(ok)) if ok else None


def megatron_2021(cluster: Cluster, out: Path) -> None:
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
    out.write_text(json.dumps(dict(
        source="Narayanan et al. 2021 (arXiv 2104.04473) Table 1; settings of "
               "examples/sc21/run_table_1.sh", cluster=dataclasses.asdict(cluster),
        rows=rows, ratio_median=statistics.median(rs), ratio_min=min(rs), ratio_max=max(rs),
        achievable_fraction_within_15pct=span), indent=1) + "\n")


def assumed_ranges(cluster: Cluster, rows: list, ests: list) -> dict[str, Any]:
    """For each assumed number (the others as the file says), the grid values keeping every
    row within its bound: (lowest, highest), or None."""
    from megazero.planner.published_bridge import bound

    out: dict[str, Any] = {}
    for name, grid in ASSUMED.items():
        ok = [v for v in grid if all(
            abs(e.retime(dataclasses.replace(cluster, **{name: v})).seconds
                / r.published_seconds - 1) <= bound(r) for r, e in zip(rows, ests))]
        out[name] = (min(ok), max(ok)) if ok else None
    return out


def moe_terms(est: Any, cluster: Cluster) -> dict[str, float]:
    """An MoE run's expert-parallel terms per step: the dispatch and combine traffic (before
    and after overlap), the grouped GEMM (and its per-kernel share), rows per expert."""
    from megazero.planner.features import Features
    from megazero.planner.moe_compute import grouped_gemm_efficiency, tokens_per_expert
    from megazero.planner.moe_cost import moe_traffic_seconds

    cfg, t = est.config, est.time
    mb, feats = est.timing["num_microbatches"], est.timing["features"] or Features()
    traffic = moe_traffic_seconds(cfg, cluster) if cfg.layout().ep > 1 else {}
    return dict(dispatch_s=mb * traffic.get("dispatch", 0.0),
                combine_s=mb * traffic.get("combine", 0.0),
                exposed_dispatch_s=t.terms.get("MoE dispatch", 0.0),
                exposed_combine_s=t.terms.get("MoE combine", 0.0),
                grouped_gemm_s=t.terms.get("MoE grouped GEMM", 0.0),
                grouped_gemm_efficiency=grouped_gemm_efficiency(cfg, cluster, feats),
                permute_s=t.terms.get("MoE permute", 0.0),
                tokens_per_expert=tokens_per_expert(cfg), step_s=t.seconds)


def bridge_h100(cluster: Cluster, out: Path) -> None:
    from megazero.planner.published_bridge import (
        BRIDGE_H100,
        MIXTRAL_LAYOUTS,
        SOURCE,
        bound,
        predict_mixtral,
    )
    from megazero.planner.published_bridge import predict as predict_row

    print(f"{SOURCE}\ncluster {cluster.name}: {cluster.device}")
    print(f"assumed: achievable_fraction {cluster.achievable_fraction}, achievable_fraction_fp8 "
          f"{cluster.achievable_fraction_fp8}, expert_kernel_overhead_us "
          f"{cluster.expert_kernel_overhead_us:g}")
    print(f"{'model':>15} {'GPUs':>5} {'prec':>6} {'gbs':>4} {'mbs':>3} {'fsdp':>4} {'tp':>2} "
          f"{'pp':>2} {'cp':>2} {'vp':>2} {'ep':>2} {'TFLOP/s':>7} {'published s':>11} "
          f"{'predicted s':>11} {'ratio':>6}  terms (s)")
    rows, ests = [], []
    for r in BRIDGE_H100:
        est = predict_row(r, cluster)
        ests.append(est)
        t = est.time
        ratio = t.seconds / r.published_seconds
        terms = ", ".join(f"{k} {x:.2f}" for k, x in t.terms.items() if x >= 0.005)
        print(f"{r.name:>15} {r.gpus:>5} {r.precision:>6} {r.global_batch:>4} "
              f"{r.micro_batch:>3} {int(r.fsdp):>4} {r.tp:>2} {r.pp:>2} {r.cp:>2} "
              f"{r.vp or 1:>2} {r.ep:>2} {r.tflops_per_gpu:>7g} {r.published_seconds:>11.2f} "
              f"{t.seconds:>11.2f} {ratio:>6.3f}  {terms}")
        row = dict(model=r.name, gpus=r.gpus, precision=r.precision,
                   global_batch=r.global_batch, micro_batch=r.micro_batch, seq=r.seq,
                   fsdp=r.fsdp, tp=r.tp, pp=r.pp, cp=r.cp, vp=r.vp, ep=r.ep,
                   features=dataclasses.asdict(r.features),
                   published_tflops_per_gpu=r.tflops_per_gpu,
                   published_tokens_per_s_per_gpu=r.tokens_per_s_per_gpu,
                   published_s=r.published_seconds, predicted_s=t.seconds, ratio=ratio,
                   bound=bound(r), predicted_tflops_per_gpu=r.flops_per_iteration
                   / (t.seconds * r.gpus) / 1e12, terms_s=t.terms, fits=est.fits,
                   device_gb=est.worst.device_total / 1e9)
        if r.moe:
            row["moe"] = moe_terms(est, cluster)
        rows.append(row)
    rs = [x["ratio"] for x in rows]
    ok = all(abs(x["ratio"] - 1) <= x["bound"] for x in rows)
    print(f"predicted / published: median {statistics.median(rs):.3f}, range "
          f"{min(rs):.3f}-{max(rs):.3f}; every row within its bound (dense 15%, MoE 20%): {ok}")
    over = [f"{x['model']} {x['device_gb']:.0f} GB" for x in rows if not x["fits"]]
    if over:  # FP8's one-byte saved activations are not in the memory model yet
        print("memory model (16-bit saved activations) over 80 GB for: " + ", ".join(over))
    print("MoE rows, per step: dispatch / combine all-to-all (exposed after overlap), grouped "
          "GEMM (efficiency), routed rows' memory traffic")
    for x in rows:
        if "moe" in x:
            e = x["moe"]
            print(f"  {x['model']:>15}: dispatch {e['dispatch_s']:.2f} s "
                  f"({e['exposed_dispatch_s']:.2f}), combine {e['combine_s']:.2f} s "
                  f"({e['exposed_combine_s']:.2f}), grouped GEMM {e['grouped_gemm_s']:.2f} s "
                  f"(efficiency {e['grouped_gemm_efficiency']:.2f} at "
                  f"{e['tokens_per_expert']:.0f} rows per expert), permute "
                  f"{e['permute_s']:.2f} s, of a {e['step_s']:.2f} s step")
    mixtral = {}
    for layout in MIXTRAL_LAYOUTS:
        mix = predict_mixtral(cluster, layout)
        mx = moe_terms(mix, cluster)
        share = (mx["exposed_dispatch_s"] + mx["exposed_combine_s"]) / mx["step_s"]
        print(f"Mixtral 8x7B, 64 H100, bf16, {layout}: step {mx['step_s']:.2f} s; all-to-all "
              f"{share:.0%} of it (dispatch {mx['dispatch_s']:.2f} s, combine "
              f"{mx['combine_s']:.2f} s), grouped GEMM {mx['grouped_gemm_s']:.2f} s "
              f"(efficiency {mx['grouped_gemm_efficiency']:.2f} at "
              f"{mx['tokens_per_expert']:.0f} rows per expert); "
              + ", ".join(f"{k} {v:.2f}" for k, v in mix.time.terms.items() if v >= 0.005))
        mixtral[layout] = dict(terms_s=mix.time.terms, alltoall_share=share, **mx)
    spans = assumed_ranges(cluster, BRIDGE_H100, ests)
    for name, span in spans.items():
        print(f"{name} keeping every row within its bound: "
              + (f"{span[0]:g}-{span[1]:g}" if span else "none"))
    out.write_text(json.dumps(dict(
        source=SOURCE, cluster=dataclasses.asdict(cluster), rows=rows,
        ratio_median=statistics.median(rs), ratio_min=min(rs), ratio_max=max(rs),
        every_row_within_bound=ok, assumed_ranges=spans,
        mixtral_8x7b_64_h100=mixtral),
        indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", choices=("megatron-2021", "bridge-h100"),
                    default="megatron-2021")
    ap.add_argument("--cluster", default=None,
                    help="default a100-80gb (megatron-2021), h100-80gb-nvlink (bridge-h100)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bridge = args.table == "bridge-h100"
    cluster = load_cluster(args.cluster or ("h100-80gb-nvlink" if bridge else "a100-80gb"))
    out = Path(args.out or RESULTS / ("planner_vs_bridge_h100.json" if bridge
                                      else "planner_vs_published.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    (bridge_h100 if bridge else megatron_2021)(cluster, out)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
