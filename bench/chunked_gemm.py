"""The GEMMs that ``--tp-comm-overlap`` splits into ``tp`` row chunks, whole and chunked: what
the chunking costs in GEMM efficiency, and the planner's efficiency model fitted to it.

    python bench/chunked_gemm.py                      # CUDA (bf16) when available, else CPU
    python bench/chunked_gemm.py --device cpu         # fp32, shapes ~100x smaller
    python bench/chunked_gemm.py --tokens 4096 --hidden 8192 --ffn 28672 --heads 64 \\
        --groups 8 --model-tp 8 --tp 2 4 8            # Llama-2 70B at TP 8 (the CUDA default)

With sequence parallelism and the overlap on (:mod:`megazero.tensor_parallel.overlap`) a
layer's column-parallel forward GEMMs (QKV, fc1: the all-gather ring), its row-parallel forward
GEMMs (proj, fc2: the reduce-scatter ring) and the row-parallel backward's input-gradient GEMMs
(proj, fc2 dgrad: the gradient all-gather ring) each run as ``tp`` GEMMs of ``rows / tp`` rows.
Each is timed here on one device at the per-rank widths of ``--model-tp`` (SwiGLU: fc1 out
``2 ffn / tp``; QKV out ``(heads + 2 groups) head_dim / tp``), whole and in ``tp`` chunks for
every ``--tp``, the modes interleaved in each repeat (order rotated), median over
``--repeats`` after ``--warmup``, in the device's training dtype (bf16 on CUDA, fp32 on CPU;
one thread on CPU, as a gloo rank under torchrun runs).

The model (``gemm_half_rate_rows`` in :mod:`megazero.planner.cluster`): a GEMM of ``M`` rows
takes time proportional to ``M + M0``, so ``tp`` chunks take ``(M + tp M0) / (M + M0)`` of the
whole GEMM's time. ``M0`` is fitted by least squares to the median chunked/whole ratio of every
GEMM and chunk count, and to each repeat's ratios for its spread. Prints a table and writes
``bench/results/chunked_gemm_<device name>.json`` (or ``--out``) with the host's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections.abc import Callable

import torch

CUDA_DEFAULTS = dict(tokens=4096, hidden=8192, ffn=28672, heads=64, groups=8, repeats=7,
                     warmup=2, inner=5)
# ~100x fewer FLOPs: a run takes well under two minutes on two busy cores
CPU_DEFAULTS = dict(tokens=512, hidden=2048, ffn=7168, heads=16, groups=2, repeats=15,
                    warmup=1, inner=1)


def gemm_shapes(hidden: int, ffn: int, heads: int, groups: int, tp: int
                ) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, weight transposed) of the chunked GEMMs of one layer on a TP rank: the
    forward ``x @ W^T`` of the four linears and the row-parallel linears' input gradient
    ``dy @ W``."""
    head_dim = hidden // heads
    qkv = (heads + 2 * groups) * head_dim // tp
    proj_in, fc2_in = hidden // tp, ffn // tp
    return [("qkv fwd", hidden, qkv, True), ("proj fwd", proj_in, hidden, True),
            ("proj dgrad", hidden, proj_in, False), ("fc1 fwd", hidden, 2 * ffn // tp, True),
            ("fc2 fwd", fc2_in, hidden, True), ("fc2 dgrad", hidden, fc2_in, False)]


def chunked_ratio(m: int, tp: int, m0: float) -> float:
    """The model's time of ``tp`` chunks over the whole GEMM's."""
    return (m + tp * m0) / (m + m0)


def fit_m0(points: list[tuple[int, int, float]]) -> float:
    """``M0`` minimising the squared error of :func:`chunked_ratio` against the measured
    ``(rows, tp, ratio)`` points (a bounded 1-D search: the model is monotone in ``M0``)."""
    def err(m0: float) -> float:
        return sum((chunked_ratio(m, tp, m0) - r) ** 2 for m, tp, r in points)

    lo = -0.9 * min(m for m, tp, _ in points) / max(tp for _, tp, _ in points)
    hi = 16.0 * max(m for m, _, _ in points)
    for _ in range(200):  # ternary search: err is convex enough over this range
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (lo, b) if err(a) <= err(b) else (a, hi)
    return (lo + hi) / 2


def make_timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    """Seconds per call of ``fn`` over ``inner`` calls: CUDA events on a GPU, else the clock."""
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], None], inner: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        return cuda_time

    def cpu_time(fn: Callable[[], None], inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner
    return cpu_time


def gemm_fn(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool, chunks: int
            ) -> Callable[[], None]:
    """``out = x @ (W^T or W)`` as one GEMM or as ``chunks`` GEMMs of consecutive rows."""
    b = w.t() if transposed else w
    xs, outs = x.chunk(chunks), out.chunk(chunks)

    def run() -> None:
        for xc, oc in zip(xs, outs):
            torch.matmul(xc, b, out=oc)
    return run


def measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    timer = make_timer(device)
    modes = [1, *args.tp]
    rows = args.tokens
    gen = torch.Generator(device="cpu").manual_seed(0)
    cases = []
    for name, k, n, transposed in gemm_shapes(args.hidden, args.ffn, args.heads, args.groups,
                                              args.model_tp):
        x = torch.randn(rows, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) if transposed
             else torch.randn(k, n, generator=gen)).to(device, dtype)
        out = torch.empty(rows, n, device=device, dtype=dtype)
        cases.append((name, k, n, {c: gemm_fn(x, w, out, transposed, c) for c in modes}))
    times: dict[str, dict[int, list[float]]] = {c[0]: {m: [] for m in modes} for c in cases}
    loads = []
    for rep in range(args.warmup + args.repeats):
        for i, (name, _, _, fns) in enumerate(cases):
            order = modes[(rep + i) % len(modes):] + modes[:(rep + i) % len(modes)]
            for c in order:
                t = timer(fns[c], args.inner)
                if rep >= args.warmup:
                    times[name][c].append(t)
        if rep >= args.warmup:
            loads.append(os.getloadavg())
    gemms = {}
    for name, k, n, _ in cases:
        whole = times[name][1]
        per_tp = {}
        for c in args.tp:
            ratios = [tc / tw for tc, tw in zip(times[name][c], whole)]
            per_tp[str(c)] = {
                "chunk_rows": rows // c,
                "chunked_ms_median": 1e3 * statistics.median(times[name][c]),
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                "ratio_max": max(ratios), "ratios": ratios}
        gemms[name] = {"rows": rows, "k": k, "n": n, "flops": 2 * rows * k * n,
                       "whole_ms_median": 1e3 * statistics.median(whole),
                       "whole_ms_min": 1e3 * min(whole), "whole_ms_max": 1e3 * max(whole),
                       "whole_tflops_median": 2 * rows * k * n / statistics.median(whole) / 1e12,
                       "tp": per_tp}
    # least squares over every GEMM and chunk count's median ratio (one preempted repeat on a
    # busy host moves a single ratio by 10x), and over each repeat's ratios for the spread
    pooled = [(rows, int(c), v["ratio_median"]) for g in gemms.values()
              for c, v in g["tp"].items()]
    per_repeat = [fit_m0([(rows, int(c), v["ratios"][i]) for g in gemms.values()
                          for c, v in g["tp"].items()]) for i in range(args.repeats)]
    m0 = fit_m0(pooled)
    for g in gemms.values():
        for c, v in g["tp"].items():
            v["model_ratio"] = chunked_ratio(rows, int(c), m0)
    return {"gemms": gemms,
            "fit": {"m0_rows": m0, "m0_per_repeat_median": statistics.median(per_repeat),
                    "m0_per_repeat_min": min(per_repeat), "m0_per_repeat_max": max(per_repeat),
                    "points": len(pooled), "repeats": args.repeats},
            "load_average_per_repeat": loads}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    for key in CUDA_DEFAULTS:
        ap.add_argument(f"--{key}", type=int, default=None,
                        help=f"default: {CUDA_DEFAULTS[key]} on CUDA, {CPU_DEFAULTS[key]} on CPU")
    ap.add_argument("--model-tp", type=int, default=8, help="the per-rank widths' TP degree")
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8], help="chunk counts")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads; default on CPU 1 (a gloo rank's, under torchrun's "
                         "OMP_NUM_THREADS=1), on CUDA torch's own")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        res = measure(args, device, dtype)
    finally:
        torch.set_num_threads(threads)
    print(f"{name}, {str(dtype).removeprefix('torch.')}, {args.tokens} rows, hidden "
          f"{args.hidden}, ffn {args.ffn}, {args.heads} heads / {args.groups} groups at tp "
          f"{args.model_tp}; {args.repeats} repeats (medians, [min, max]); load "
          f"{os.getloadavg()[0]:.2f}")
    head = "".join(f"{'x' + str(c) + ' chunks':>24}" for c in args.tp)
    print(f"{'GEMM':<11} {'K':>6} {'N':>6} {'whole ms':>22} {'TFLOP/s':>8}{head}")
    for gname, g in res["gemms"].items():
        cells = "".join(f"{v['ratio_median']:>8.3f} [{v['ratio_min']:.2f}, {v['ratio_max']:.2f}]"
                        f" m{v['model_ratio']:.3f}" for v in g["tp"].values())
        print(f"{gname:<11} {g['k']:>6} {g['n']:>6} {g['whole_ms_median']:>8.3f} "
              f"[{g['whole_ms_min']:.3f}, {g['whole_ms_max']:.3f}] "
              f"{g['whole_tflops_median']:>8.3f}{cells}")
    f = res["fit"]
    print(f"chunked/whole time ratio, m: the fitted model's (M + tp M0) / (M + M0) with M0 = "
          f"{f['m0_rows']:.1f} rows (least squares over the {f['points']} median ratios; per "
          f"repeat median "
          f"{f['m0_per_repeat_median']:.1f} [{f['m0_per_repeat_min']:.1f}, "
          f"{f['m0_per_repeat_max']:.1f}])")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"chunked_gemm_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json")
    data = {"device": name, "dtype": str(dtype), "torch": torch.__version__,
            "cpus": os.cpu_count(), "threads": args.threads or threads,
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            # the host's load (1, 5, 15 min) at the end and after each repeat
            "load_average": os.getloadavg(), **res}
    with open(out, "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"wrote {out}")
    return data


if __name__ == "__main__":
    main()
