"""How long tools/plan_layout.py takes to search every axis (TP, CP, PP and its schedules, EP and
ETP, SP, micro-batch, ZeRO, offload, recomputation) for the two plans the layout-search issue
names: Mixtral 8x7B on 8 DGX H100 nodes (64 GPUs, global batch 256, Megatron's example model)
and Llama-3 8B on one (8 GPUs, global batch 128). Each run is a fresh process (no cache carried
over), ``--repeats`` times; reported: median [min-max] seconds of the search as the tool reports
it and of the whole command, the layouts timed, the winner and, for Mixtral, the fastest layout
with expert parallelism beside the layout of Megatron's example script (tp 1, pp 4, ep 8,
distributed optimizer), all three by predicted step time.

    python bench/plan_layout_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASES = {
    "mixtral-8x7b / 64 H100": ["--model", "mixtral-8x7b", "--num-nodes", "8",
                               "--gpus-per-node", "8", "--global-batch-size", "256",
                               "--moe-token-dispatcher-type", "alltoall"],
    "llama3-8b / 8 H100": ["--model", "llama3-8b", "--world-size", "8",
                           "--global-batch-size", "128"],
}
COMMON = ["--cluster", "h100-80gb-nvlink", "--bf16", "--top", "3", "--no-progress"]


def run(args: list[str]) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_layout.py"), *args,
                           *COMMON], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    wall = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"plan_layout.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    m = re.search(r"searched (\d+) layouts of (\d+) shapes in ([\d.]+) s", proc.stdout)
    assert m is not None, proc.stdout
    winner = re.search(r"^winner: (.*)$", proc.stdout, re.M)
    row = re.search(r"^\s+1 .*?\s([\d.]+)\s+[\d.]+%\s+winner$", proc.stdout, re.M)
    ep = re.search(r"fastest with expert parallelism: (.*?), ([\d.]+) s", proc.stdout)
    return {"search_s": float(m.group(3)), "wall_s": wall, "timed": int(m.group(1)),
            "shapes": int(m.group(2)), "winner": winner.group(1) if winner else None,
            "winner_step_s": float(row.group(1)) if row else None,
            "ep_layout": ep.group(1) if ep else None,
            "ep_step_s": float(ep.group(2)) if ep else None}


def megatron_example_step_s() -> float:
    """Predicted step time of Megatron's examples/mixtral layout, the hand-made reference."""
    import warnings

    from megazero.planner.cluster import load_cluster
    from megazero.planner.estimate import estimate
    from megazero.planner.presets import preset_argv
    from megazero.planner.search import _config

    warnings.simplefilter("ignore")
    h100 = load_cluster("h100-80gb-nvlink")
    base = [*preset_argv("mixtral-8x7b"), "--bf16", "--moe-token-dispatcher-type", "alltoall"]
    cfg = _config(base, ["--pipeline-model-parallel-size=4", "--expert-model-parallel-size=8",
                         "--zero-stage=1", "--micro-batch-size=1", "--global-batch-size=256",
                         "--sequence-parallel"], 64, h100)
    return estimate(cfg, h100, stages=[0, 3]).time.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = {}
    print(f"{'case':<26}{'search s':>22}{'command s':>22}{'layouts':>9}  winner (step s)")
    for name, case in CASES.items():
        runs = [run(case) for _ in range(args.repeats)]
        s = [r["search_s"] for r in runs]
        w = [r["wall_s"] for r in runs]
        last = runs[-1]
        results[name] = {"search_s": s, "wall_s": w, **{k: last[k] for k in (
            "timed", "shapes", "winner", "winner_step_s", "ep_layout", "ep_step_s")}}
        print(f"{name:<26}{statistics.median(s):>9.1f} [{min(s):.1f}-{max(s):.1f}]"
              f"{statistics.median(w):>12.1f} [{min(w):.1f}-{max(w):.1f}]{last['timed']:>9}  "
              f"{last['winner']} ({last['winner_step_s']})")
        if last["ep_layout"]:
            print(f"{'':<26}fastest with expert parallelism: {last['ep_layout']} "
                  f"({last['ep_step_s']})")
    hand = megatron_example_step_s()
    results["mixtral-8x7b / 64 H100"]["megatron_example_step_s"] = hand
    print(f"{'':<26}Megatron's example layout (tp1 pp4 ep8, distributed optimizer, SP): "
          f"{hand:.3f} s predicted")
    out = os.path.join(ROOT, "bench", "results", "plan_layout_speed.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"cpus": os.cpu_count(), "repeats": args.repeats, "cases": results}, f,
                  indent=2)
    print(f"written {out}")


if __name__ == "__main__":
    main()
