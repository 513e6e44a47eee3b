"""Peak host memory while one rank's model chunks are built at ZeRO stages 0-2: created on the
device one parameter at a time (now) against built on the host and then moved (before).

    PYTHONPATH=$PWD python bench/init_device_memory.py   # prints a table, writes
                                                         # bench/results/init_device_memory.json

A GPT of ~190M parameters (hidden 1024, 12 layers, vocab 32000, untied output layer) at tp 1.
Each row runs in a fresh process: the rise of its peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) from just before the build to just after, against the rank's fp32
weights and its largest tensor. Two devices:

* ``meta`` stands in for a GPU on this CPU-only machine: device memory that is not the host's
  (a copy into it costs nothing), so the host rise is exactly what a GPU rank's host pays;
* ``cpu``: the device is the host, so the weights themselves are host memory.

Methods: ``device`` is ``megazero.training.builders.build_model_chunks_on`` (meta build, then each
parameter created on the device and filled chunk by chunk from the host generator); ``host`` is the
previous path (``build_model_chunks`` on the host, then ``.to(device)``). Three rounds each:
medians, with the spread (max - min) in MiB.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLAGS = ("--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
         "--max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 1 "
         "--train-iters 1 --mock-data --untie-embeddings-and-output-weights")
ROUNDS = 3


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def child(method: str, device_name: str) -> dict:
    import torch

    from megazero.config import load_config
    from megazero.distributed.topology import ParallelTopology
    from megazero.pipeline.partition import build_model_chunks
    from megazero.training.builders import build_model_chunks_on

    torch.set_num_threads(1)
    device, topo = torch.device(device_name), ParallelTopology.single()

    def build(flags: str):
        cfg = load_config(flags.split(), 1)
        if method == "device":
            return build_model_chunks_on(cfg, topo, device)[0]
        chunks = build_model_chunks(cfg.model, topo, None, seed=cfg.train.seed)
        return [c.to(device) for c in chunks]

    build(FLAGS.replace("--hidden-size 1024", "--hidden-size 64").replace(
        "--vocab-size 32000", "--vocab-size 100"))  # imports and kernels are not the model's
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    chunks = build(FLAGS)
    seconds = time.perf_counter() - t0
    params = [p for c in chunks for p in c.parameters()]
    return {"method": method, "device": device_name, "init_s": seconds,
            "peak_rise_mib": (_kib("VmHWM") - base) / 1024,
            "weights_mib": sum(p.numel() * 4 for p in params) / 2**20,
            "largest_tensor_mib": max(p.numel() * 4 for p in params) / 2**20,
            "params": sum(p.numel() for p in params)}


def main() -> None:
    rows = []
    for device in ("meta", "cpu"):
        for method in ("host", "device"):
            runs = []
            for _ in range(ROUNDS):
                out = subprocess.run([sys.executable, __file__, "--child", method, device],
                                     check=True, capture_output=True, text=True).stdout
                runs.append(json.loads(out.strip().splitlines()[-1]))
            peaks = [r["peak_rise_mib"] for r in runs]
            times = [r["init_s"] for r in runs]
            row = dict(runs[0], peak_rise_mib=statistics.median(peaks),
                       peak_spread_mib=max(peaks) - min(peaks), init_s=statistics.median(times),
                       init_spread_s=max(times) - min(times), rounds=ROUNDS)
            held = row["weights_mib"] if device == "cpu" else 0.0  # the weights on the host
            row["transient_over_largest"] = (row["peak_rise_mib"] - held) / \
                row["largest_tensor_mib"]
            rows.append(row)
    print(f"model: {rows[0]['params'] / 1e6:.0f}M parameters, fp32 weights "
          f"{rows[0]['weights_mib']:.0f} MiB, largest tensor {rows[0]['largest_tensor_mib']:.0f}"
          " MiB; host peak rise during the build (median of 3, spread)")
    print(f"{'device':>6} {'method':>7} {'peak rise MiB':>14} {'spread':>7} "
          f"{'(rise - host weights) / largest':>32} {'init s':>7}")
    for r in rows:
        print(f"{r['device']:>6} {r['method']:>7} {r['peak_rise_mib']:14.1f} "
              f"{r['peak_spread_mib']:7.1f} {r['transient_over_largest']:32.2f} "
              f"{r['init_s']:7.2f}")
    path = Path(__file__).parent / "results" / "init_device_memory.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"flags": FLAGS, "threads": 1, "rows": rows}, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        main()
