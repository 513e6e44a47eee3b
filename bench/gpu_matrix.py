"""Every training path of ``pretrain_gpt.py`` on one device, each saved and resumed.

    python bench/gpu_matrix.py                    # the matrix on the GPU (NCCL, one rank)
    python bench/gpu_matrix.py --device cpu       # the same on the CPU (gloo), a smoke run

Each case trains a small GPT for ``--iters`` iterations with ``--deterministic-mode``, saving
half-way; a second run loads the half-way checkpoint and trains to the end. The resumed run's
losses must equal the uninterrupted run's bitwise (deterministic kernels, the RNG states and the
data position restored). The cases: bf16 at ZeRO 0-3, fp16 (dynamic loss scale) at ZeRO 2,
ZeRO 3 with full recompute, CPU optimizer offload with pinned memory, ZeRO 3 with NVMe offload of
the parameters and the optimizer under a local path. Beside each: how far its losses are from
bf16 ZeRO 0's (the stages train the same model; bf16 rounding orders differ), the wall time and
the peak device memory. Cases run ``--jobs`` at a time; a table is printed and JSON written to
``bench/results/gpu_matrix_<device>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
         "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "4",
         "--global-batch-size", "16", "--lr", "1e-3", "--lr-warmup-iters", "4",
         "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--attention-dropout", "0.1",
         "--hidden-dropout", "0.1", "--log-interval", "1", "--eval-interval", "1000",
         "--eval-iters", "0", "--seed", "11", "--deterministic-mode"]


def cases(workdir: str) -> dict[str, tuple[list[str], dict[str, Any] | None]]:
    """name -> (flags, DeepSpeed JSON or None)."""
    nvme = os.path.join(workdir, "nvme")
    out: dict[str, tuple[list[str], dict[str, Any] | None]] = {
        f"bf16 zero-{s}": (["--bf16", "--zero-stage", str(s)], None) for s in range(4)}
    out["fp16 zero-2"] = (["--fp16", "--zero-stage", "2"], None)
    out["bf16 zero-3 full recompute"] = (
        ["--bf16", "--zero-stage", "3", "--recompute-granularity", "full",
         "--recompute-method", "uniform"], None)
    out["bf16 zero-2 cpu-offload pinned"] = (["--bf16"], {"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
    out["bf16 zero-3 nvme params+optim"] = (["--bf16"], {"zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True}}})
    # what has a GPU path since: FP8 GEMMs per recipe (the delayed amax history resumes with
    # the checkpoint), asynchronous saves with pinned staging, the weight-gradient split
    # (1F1B with W deferred) and the elementwise fusions off
    for recipe in ("tensorwise", "delayed", "blockwise"):
        out[f"bf16 zero-1 fp8 {recipe}"] = (
            ["--bf16", "--zero-stage", "1", "--fp8-format", "hybrid", "--fp8-recipe", recipe],
            None)
    out["bf16 zero-3 fp8 param gather"] = (
        ["--bf16", "--zero-stage", "3", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
         "--fp8-param-gather"], None)
    out["bf16 zero-2 async save"] = (["--bf16", "--zero-stage", "2", "--async-save"], None)
    out["bf16 zero-2 delayed wgrad"] = (["--bf16", "--zero-stage", "2", "--delay-wgrad-compute"],
                                        None)
    out["bf16 zero-3 unfused"] = (["--bf16", "--zero-stage", "3", "--no-bias-gelu-fusion",
                                   "--no-bias-dropout-fusion", "--no-rope-fusion"], None)
    return out


def _losses(path: str) -> dict[int, float]:
    out = {}
    for line in open(path, encoding="utf-8"):
        rec = json.loads(line)
        if "lm loss" in rec:
            out[int(rec["iteration"])] = float(rec["lm loss"])
    return out


def _peak(path: str) -> float | None:
    peaks = [rec["memory_mb"] for rec in map(json.loads, open(path, encoding="utf-8"))
             if rec.get("memory_mb") is not None]
    return max(peaks) if peaks else None


def _train(flags: list[str], log: str, env: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags,
                           "--log-json", log], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def run_case(name: str, flags: list[str], ds: dict[str, Any] | None, args: argparse.Namespace,
             workdir: str) -> dict[str, Any]:
    d = os.path.join(workdir, name.replace(" ", "_").replace("+", "_"))
    os.makedirs(d)
    if ds is not None:
        for block in ds["zero_optimization"].values():
            if isinstance(block, dict) and "nvme_path" in block:
                os.makedirs(block["nvme_path"] + "-" + os.path.basename(d), exist_ok=True)
                block["nvme_path"] += "-" + os.path.basename(d)
        with open(os.path.join(d, "ds.json"), "w", encoding="utf-8") as f:
            json.dump(ds, f)
        flags = [*flags, "--deepspeed-config", os.path.join(d, "ds.json")]
    if args.device == "cpu":
        flags = [*flags, "--distributed-backend", "gloo"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    ck, half = os.path.join(d, "ck"), args.iters // 2
    common = [*MODEL, *flags, "--train-iters", str(args.iters)]
    t0 = time.perf_counter()
    rc, out = _train([*common, "--save", ck, "--save-interval", str(half)],
                     os.path.join(d, "straight.jsonl"), env)
    row: dict[str, Any] = {"case": name, "flags": flags, "deepspeed_config": ds}
    if rc:
        return {**row, "ok": False, "error": f"straight run failed (exit {rc}):\n{out}"}
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(half))
    rc, out2 = _train([*common, "--load", ck], os.path.join(d, "resumed.jsonl"), env)
    wall = time.perf_counter() - t0
    if rc:
        return {**row, "ok": False, "error": f"resumed run failed (exit {rc}):\n{out2}"}
    straight = _losses(os.path.join(d, "straight.jsonl"))
    resumed = _losses(os.path.join(d, "resumed.jsonl"))
    tail = {i: v for i, v in straight.items() if i > half}
    diff = max((abs(resumed.get(i, float("nan")) - v) / abs(v) for i, v in tail.items()),
               default=float("nan"))
    bitwise = bool(tail) and all(resumed.get(i) == v for i, v in tail.items())
    return {**row, "ok": bitwise, "losses": [straight[i] for i in sorted(straight)],
            "resumed_losses": [resumed[i] for i in sorted(resumed)],
            "resume_bitwise": bitwise, "resume_max_rel_diff": diff,
            "final_loss": straight[max(straight)], "wall_s": wall,
            "peak_mb": _peak(os.path.join(d, "straight.jsonl")),
            "error": None if bitwise else "resumed losses differ from the straight run's"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=4, help="cases run at the same time")
    ap.add_argument("--only", default=None, help="comma-separated substrings of case names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    workdir = tempfile.mkdtemp(prefix="gpu-matrix-")
    todo = cases(workdir)
    if args.only:
        keys = args.only.split(",")
        todo = {k: v for k, v in todo.items() if any(s in k for s in keys)}
    with futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = {name: pool.submit(run_case, name, f, ds, args, workdir)
                for name, (f, ds) in todo.items()}
        rows = [jobs[name].result() for name in todo]
    ref = next((r for r in rows if r["case"] == "bf16 zero-0" and "losses" in r), None)
    print(f"{'case':32} {'ok':3} {'final loss':>10} {'resume':>8} {'vs zero-0':>10} "
          f"{'wall s':>7} {'peak MB':>8}")
    for r in rows:
        if "losses" in r and ref is not None:
            r["max_rel_diff_vs_bf16_zero0"] = max(
                abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        if "losses" not in r:
            print(f"{r['case']:32} NO  {r['error']}")
            continue
        vs = r.get("max_rel_diff_vs_bf16_zero0")
        resume = "bitwise" if r["resume_bitwise"] else f"{r['resume_max_rel_diff']:.1e}"
        print(f"{r['case']:32} {'yes' if r['ok'] else 'NO':3} {r['final_loss']:10.5f} "
              f"{resume:>8} "
              f"{f'{vs:.1e}' if vs is not None else 'n/a':>10} {r['wall_s']:7.1f} "
              f"{r['peak_mb'] if r['peak_mb'] is not None else 'n/a':>8}")
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"gpu_matrix_{dev.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"device": dev, "torch": torch.__version__, "iters": args.iters,
                   "model": MODEL, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
