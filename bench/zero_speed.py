"""Step time of ZeRO stages 0, 1, 2, 3, 2+offload, 3+offload at dp 2 on gloo, against a plain
single-process PyTorch loop of the same model (the limit) and, when available, DeepSpeed.

Model: GPT, vocab 4096, hidden 256, 4 layers, 4 heads, seq 128, micro-batch 4 per rank, fp32,
AdamW, clipping 1.0, dropout 0. All configurations live in one world of 2 ranks (one intra-op
thread each) and run in alternating rounds, so machine-load drift hits every case alike. The
plain loop runs on both ranks at once, each an independent single-process loop with no
communication: the same per-process work and the same competition for cores as a data-parallel
rank, i.e. the limit a rank can reach on this machine. Reported: median and minimum ms/step of
rank 0 (the minimum is the least-disturbed step when other jobs share the machine).

ZeRO settings: ``overlap_comm`` on, ``reduce_bucket_size`` 1e6 (four buckets for this 4.2M model),
other keys at DeepSpeed defaults. DeepSpeed 0.19.8 runs the same model (megazero's GPTModel,
tp = 1) and the same settings when ``MEGAZERO_DEEPSPEED_PYTHON`` names a Python with DeepSpeed
installed (each case a 2-process torchrun launch, rounds alternating with megazero's);
otherwise its column says so.

    python bench/zero_speed.py [--rounds 3] [--steps 3]

Prints the table and writes bench/results/zero_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megazero.config import ModelConfig, OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.model import GPTModel
from megazero.testing import run_distributed
from megazero.topology import ParallelTopology
from megazero.zero import build_zero_optimizer
from megazero.zero.reference import torch_adamw

MBS, DP = 4, 2
OPT = OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0)
CPU = OffloadConfig(device="cpu")
ZERO_COMMON = dict(overlap_comm=True, reduce_bucket_size=1_000_000)
CASES: list[tuple[str, dict[str, Any] | None]] = [
    ("plain", None),
    ("0", dict(stage=0)),
    ("1", dict(stage=1)),
    ("2", dict(stage=2)),
    ("3", dict(stage=3)),
    ("2+offload", dict(stage=2, offload_optimizer=CPU)),
    ("3+offload", dict(stage=3, offload_optimizer=CPU, offload_param=CPU)),
]


def model_config() -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                       vocab_size=4096, attention_dropout=0.0, hidden_dropout=0.0)


def make_step(case: dict[str, Any] | None, topo: ParallelTopology) -> Callable[[Any], float]:
    """One training step function for a case: returns the loss. This is the seam where the
    training entry point (``pretrain_gpt.py --mock-data``) can be substituted later."""
    cfg = model_config()
    if case is None:
        model = GPTModel(cfg, ParallelTopology.single())
        opt = torch_adamw(model, OPT)

        def plain(batch: Any) -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(*batch).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad)
            opt.step()
            return loss.item()
        return plain
    model = GPTModel(cfg, topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(**{**ZERO_COMMON, **case}),
                                  PrecisionConfig(), topo)

    def zero(batch: Any) -> float:
        engine.zero_grad()
        loss = model(*batch).mean()
        engine.backward(loss)
        engine.finish_grad_sync()
        engine.step()
        return loss.item()
    return zero


def _speed_world(rank: int, world_size: int, rounds: int, steps: int, rotate: int = 0
                 ) -> dict[str, list[float]]:
    topo = ParallelTopology.build()
    cfg = model_config()
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (MBS, cfg.seq_length), generator=g)
    batch = (tokens, torch.roll(tokens, -1, 1))
    fns = {name: make_step(case, topo) for name, case in CASES}
    for fn in fns.values():  # warm-up (stage 3 records its execution order on the first step)
        fn(batch)
    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for r in range(rounds):
        k = (r + rotate) % len(CASES)
        order = CASES[k:] + CASES[:k]  # rotate: alternating runs
        for name, _case in order:
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                fns[name](batch)
                times[name].append(1000 * (time.perf_counter() - t0))
    dist.barrier()
    return times


DS_SCRIPT = r'''
import json, os, statistics, sys, time
sys.path.insert(0, os.environ["MEGAZERO_ROOT"])
import torch, deepspeed
from megazero.model import GPTModel
from megazero.topology import ParallelTopology
sys.path.insert(0, os.path.join(os.environ["MEGAZERO_ROOT"], "bench"))
from zero_speed import OPT, MBS, ZERO_COMMON, model_config, ds_zero_block
stage, offload, steps = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
cfg = model_config()
model = GPTModel(cfg, ParallelTopology.single())
decay = [p for p in model.parameters() if p.ndim >= 2]
rest = [p for p in model.parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=OPT.lr,
                        weight_decay=OPT.weight_decay)
ds = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1,
      "gradient_clipping": OPT.clip_grad, "zero_allow_untested_optimizer": True,
      "zero_force_ds_cpu_optimizer": False, "zero_optimization": ds_zero_block(stage, offload)}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
g = torch.Generator().manual_seed(rank)
tokens = torch.randint(0, cfg.vocab_size, (MBS, cfg.seq_length), generator=g)
labels = torch.roll(tokens, -1, 1)
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    loss = engine(tokens, labels).mean()
    engine.backward(loss)
    engine.step()
    if i:
        times.append(1000 * (time.perf_counter() - t0))
if rank == 0:
    print("MEGAZERO_DS_RESULT " + json.dumps(times), flush=True)
'''


def ds_zero_block(stage: int, offload: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"stage": stage, **ZERO_COMMON}
    if offload:
        block["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            block["offload_param"] = {"device": "cpu"}
    return block


def run_deepspeed(python: str, steps: int) -> dict[str, list[float] | str]:
    """Each DeepSpeed case in its own 2-process torchrun launch (DeepSpeed keeps global state)."""
    out: dict[str, list[float] | str] = {}
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "ds_step.py")
        with open(script, "w") as f:
            f.write(DS_SCRIPT)
        env = {**os.environ, "MEGAZERO_ROOT": root, "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": "1"}
        for name, case in CASES:
            if case is None:
                continue
            offload = "offload" in name
            cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(DP),
                   "--master_port", str(29700 + len(out)), script, str(case["stage"]),
                   "1" if offload else "0", str(steps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEGAZERO_DS_RESULT")]
            if lines:
                out[name] = json.loads(lines[-1].split(" ", 1)[1])
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                out[name] = "failed: " + " | ".join(tail)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_speed.json"))
    args = ap.parse_args(argv)
    ds_python = os.environ.get("MEGAZERO_DEEPSPEED_PYTHON")
    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    raw: dict[str, list[float] | str] = {}
    # Rounds alternate between megazero (all cases, rotated) and DeepSpeed (all cases), so load
    # drift on a shared machine hits both alike.
    for r in range(args.rounds):
        got = run_distributed(_speed_world, DP, 1, args.steps, r, timeout=1800)[0]
        for k, v in got.items():
            times[k] += v
        if ds_python:
            for k, v in run_deepspeed(ds_python, args.steps).items():
                if isinstance(v, list):
                    prev = raw.get(k, [])
                    raw[k] = (prev if isinstance(prev, list) else []) + v
                elif k not in raw:
                    raw[k] = v
    med = {k: statistics.median(v) for k, v in times.items()}
    ds: dict[str, Any] = {k: statistics.median(v) if isinstance(v, list) and v else v
                          for k, v in raw.items()}
    plain = med["plain"]
    print(f"GPT 4.2M (V4096 h256 L4 a4 s128 mb{MBS}) fp32 AdamW clip 1.0, dp {DP} on gloo, "
          f"median of {args.rounds}x{args.steps} steps")
    # min: the least-disturbed step, a steadier estimate than the median on a shared machine
    low = {k: min(v) for k, v in times.items()}
    ds_low = {k: min(v) for k, v in raw.items() if isinstance(v, list) and v}
    print(f"{'case':>10} {'median':>8} {'vs plain':>8} {'min':>7} {'vs plain':>8} "
          f"{'DeepSpeed median':>16} {'DS min':>7}")
    rows = []
    for name, _ in CASES:
        d = ds.get(name, "n/a" if name == "plain" else
                   "not run: set MEGAZERO_DEEPSPEED_PYTHON" if not ds_python else "missing")
        d_txt = (f"{d:16.1f} {ds_low[name]:7.1f}" if isinstance(d, float)
                 else f" {str(d)[:60]}")
        print(f"{name:>10} {med[name]:8.1f} {med[name] / plain:8.3f} {low[name]:7.1f} "
              f"{low[name] / low['plain']:8.3f}{d_txt}")
        rows.append(dict(case=name, ms_per_step=med[name], ratio_to_plain=med[name] / plain,
                         min_ms=low[name], min_ratio_to_plain=low[name] / low["plain"],
                         deepspeed_ms_per_step=d, deepspeed_min_ms=ds_low.get(name),
                         samples=times[name], deepspeed_samples=raw.get(name)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "model": model_config().__dict__, "micro_batch": MBS,
                   "dp": DP, "zero": ZERO_COMMON, "threads_per_rank": 1}, f, indent=1,
                  default=str)


if __name__ == "__main__":
    sys.exit(main())
