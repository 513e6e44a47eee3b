"""Memory per rank for ZeRO stages 0, 1, 2, 2+offload, 3, 3+offload at dp 2 and 4.

For each case: model-state bytes (the engine's ``memory_report``: real tensor storage of
parameters, gradients and optimizer state, split into the model's device and offloaded host
memory) after the forward, after the backward and after the optimizer step, plus activations
after the forward, and the median step time. On a CPU-only machine there is no CUDA allocator to
ask, so activations are the bytes of the tensors autograd saved for backward (counted through
``saved_tensors_hooks``, each storage once, parameters excluded): tracked tensor bytes, not
allocator peaks. The ordering 2+offload > 3 on the device needs, by the formulas, N > 3 in
fp32 (4Ψ + 4Ψ/N vs 16Ψ/N) and N > 7 with fp16 (2Ψ + 2Ψ/N vs 16Ψ/N); the JSON records whether
it holds at each dp.

    python bench/zero_memory.py [--precision fp32|fp16] [--steps 4]

Prints the table and writes bench/results/zero_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megazero.config import ModelConfig, OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.testing import run_distributed
from megazero.testing.reference import formula_bytes
from megazero.zero import build_zero_optimizer
from megazero.zero.accounting import formula_comm_bytes

CPU = OffloadConfig(device="cpu")
CASES: list[tuple[str, dict[str, Any]]] = [
    ("0", dict(stage=0)),
    ("1", dict(stage=1)),
    ("2", dict(stage=2)),
    ("2+offload", dict(stage=2, offload_optimizer=CPU)),
    ("3", dict(stage=3)),
    ("3+offload", dict(stage=3, offload_optimizer=CPU, offload_param=CPU)),
]
MB = 2**20


def model_config() -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                       vocab_size=2048, attention_dropout=0.0, hidden_dropout=0.0)


class SavedBytes:
    """Bytes of the storages autograd saves during a forward, each storage counted once."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            # Saved by reference to the parameter object: at stage 3 its gathered storage is
            # released after the forward and re-gathered for the backward, not kept alive.
            return t
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    def total(self, exclude: set[int]) -> int:
        return sum(n for p, n in self.storages.items() if p not in exclude)


def _zero_config(kw: dict[str, Any]) -> ZeroConfig:
    # Small buckets and a low persistence threshold so a model this small still shards.
    return ZeroConfig(**{"reduce_bucket_size": 200_000, "stage3_param_persistence_threshold": 0,
                         "stage3_max_reuse_distance": 0, **kw})


def _memory_world(rank: int, world_size: int, precision: str, steps: int) -> list[dict]:
    topo = ParallelTopology.build()
    cfg = model_config()
    prec = PrecisionConfig(fp16=precision == "fp16", initial_scale_power=8)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.roll(tokens, -1, 1)
    rows = []
    for name, kw in CASES:
        model = GPTModel(cfg, topo)
        psi = sum(p.numel() for p in model.parameters())  # before stage 3 releases them
        engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-4), _zero_config(kw), prec,
                                      topo)
        times = []
        for _ in range(steps + 1):
            saved = SavedBytes()
            t0 = time.perf_counter()
            engine.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = model(tokens, labels).float().mean()
            fwd = engine.memory_report()
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            act = saved.total(params)
            engine.backward(loss)
            engine.finish_grad_sync()
            bwd = engine.memory_report()
            engine.step()
            times.append(time.perf_counter() - t0)
            after = engine.memory_report()
        offload = "offload" in name
        comm = engine.comm_report()["logical_bytes"]
        rows.append(dict(
            case=name, dp=topo.dp_size, precision=precision, activations=act,
            model_state_total=after["total"], params=psi,
            formula=formula_bytes(kw["stage"], psi, topo.dp_size, precision == "fp16", offload),
            dp_bytes_moved=sum(v for k, v in comm.items() if k.startswith("dp/")
                               and "scalar" not in k),
            comm_formula=formula_comm_bytes(kw["stage"], psi, topo.dp_size,
                                            2 if precision == "fp16" else 4),
            after_forward=fwd["device_total"] + act, after_backward=bwd["device_total"],
            after_step=after["device_total"], offload=after["offload_total"],
            model_states=after["bytes"], padding_elements=after["padding_elements"],
            step_ms=1000 * statistics.median(times[1:])))
        del engine, model
    return rows


def check_order(rows: list[dict]) -> dict[str, bool]:
    """Whether device memory decreases 0 > 1 > 2 > 2+offload > 3 > 3+offload (after step)."""
    out = {}
    for prec in sorted({r["precision"] for r in rows}):
        for dp in sorted({r["dp"] for r in rows}):
            mine = {r["case"]: r["after_step"] for r in rows if r["dp"] == dp
                    and r["precision"] == prec}
            seq = [mine[c] for c, _ in CASES]
            out[f"{prec} dp{dp}"] = all(a > b for a, b in zip(seq, seq[1:]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=["fp32", "fp16", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_memory.json"))
    args = ap.parse_args(argv)
    rows: list[dict] = []
    precisions = ["fp32", "fp16"] if args.precision == "both" else [args.precision]
    for prec in precisions:
        for dp in (2, 4):
            rows += run_distributed(_memory_world, dp, prec, args.steps, timeout=900)[0]
    psi = rows[0]["params"]
    print(f"GPT {psi / 1e6:.3f}M params; MB = 2^20 bytes per rank; device columns: the model's "
          f"device (CPU here); activations = saved-for-backward tensor bytes (tracked tensors, "
          f"not a CUDA allocator)")
    print(f"{'prec':>4} {'dp':>2} {'stage':>9} {'fwd MB':>7} {'bwd MB':>7} {'step MB':>7} "
          f"{'host MB':>7} {'act MB':>6} {'states/formula':>14} {'pad':>4} "
          f"{'dp bytes/formula':>16} {'ms/step':>8}")
    for r in rows:
        print(f"{r['precision']:>4} {r['dp']:>2} {r['case']:>9} {r['after_forward'] / MB:7.2f} "
              f"{r['after_backward'] / MB:7.2f} {r['after_step'] / MB:7.2f} "
              f"{r['offload'] / MB:7.2f} {r['activations'] / MB:6.2f} "
              f"{r['model_state_total'] / r['formula']:14.4f} {r['padding_elements']:4d} "
              f"{r['dp_bytes_moved'] / r['comm_formula']:16.4f} {r['step_ms']:8.1f}")
    order = check_order(rows)
    print("device memory after step strictly decreasing 0>1>2>2+offload>3>3+offload:", order)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"precisions": precisions, "params": psi, "rows": rows, "order": order,
                   "model": model_config().__dict__}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
