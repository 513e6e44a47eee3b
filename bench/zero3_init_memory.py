"""Peak host memory per rank while a ~1B-parameter GPT is built and partitioned by ZeRO stage 3.

Four gloo ranks (dp 4, tp = pp = 1) each run
``megazero.training.builders.build_model_and_optimizer`` (the ``pretrain_gpt.py`` path): the chunks
are built on the meta device and every unit materialises only this rank's partition. Measured per
rank: the rise of the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) from
just before the build to just after the engine exists (before the first step: Adam's moments are
allocated by the first step and are not included), against

* ``partition``: the bytes this rank's engine holds: bf16 parameter shards, gradient shards,
  fp32 master shards, persistent units held whole;
* ``one unit``: the largest unit gathered in full (bf16), what a forward holds at most beside
  the partition (the layer being gathered);
* ``full model``: what the previous path held on every rank before partitioning (the whole
  model in fp32).

    PYTHONPATH=$PWD python bench/zero3_init_memory.py   # prints a table, writes
                                                        # bench/results/zero3_init_memory.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, DP = 18, 2048, 16, 50304, 2048, 4


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _rank(rank: int, world_size: int) -> dict:
    import torch

    from megazero.config import load_config
    from megazero.distributed.topology import ParallelTopology
    from megazero.training.builders import build_model_and_optimizer

    def config(layers: int, hidden: int, heads: int, vocab: int, seq: int):
        return load_config((
            f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} "
            f"--seq-length {seq} --max-position-embeddings {seq} --vocab-size {vocab} "
            "--micro-batch-size 1 --train-iters 1 --mock-data --bf16 --zero-stage 3").split(),
            world_size)

    topo = ParallelTopology.build(tp=1, pp=1)
    # A tiny build first: imports and first-use code pages are not the model's memory.
    build_model_and_optimizer(config(2, 64, 4, 100, 32), topo, torch.device("cpu"))
    cfg = config(LAYERS, HIDDEN, HEADS, VOCAB, SEQ)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    chunks, engine = build_model_and_optimizer(cfg, topo, torch.device("cpu"))
    seconds = time.perf_counter() - t0
    peak = (_kib("VmHWM") - base) * 1024
    units = [u for s in engine.stores for u in s.units]
    elem = torch.tensor([], dtype=cfg.precision.params_dtype).element_size()
    held = sum((u.padded if u.persistent else u.shard_size) * elem
               + u.grad_shard.numel() * u.grad_shard.element_size() for u in units)
    masters = sum(p.master.numel() * p.master.element_size() for p in engine.masters.pieces
                  if p.master is not None)
    if getattr(engine.masters, "flat", None) is not None:
        masters = engine.masters.flat.numel() * engine.masters.flat.element_size()
    params = sum(u.numel for u in units)
    one_unit = max(u.padded for u in units) * elem
    return {"rank": rank, "params": params, "build_s": seconds, "peak_rise_mib": peak / 2**20,
            "partition_mib": (held + masters) / 2**20, "one_unit_mib": one_unit / 2**20,
            "full_model_fp32_mib": params * 4 / 2**20,
            "peak_over_partition_plus_unit": peak / (held + masters + one_unit)}


def main() -> None:
    from megazero.testing import run_distributed

    rows = run_distributed(_rank, DP, timeout=1800)
    print(f"model: {rows[0]['params'] / 1e9:.3f}B parameters ({LAYERS} layers, hidden {HIDDEN}, "
          f"vocab {VOCAB}), bf16, ZeRO-3 dp {DP}")
    print(f"{'rank':>4} {'build s':>8} {'peak rise MiB':>14} {'partition MiB':>14} "
          f"{'one unit MiB':>13} {'full fp32 MiB':>14} {'peak/(part+unit)':>17}")
    for r in rows:
        print(f"{r['rank']:>4} {r['build_s']:8.1f} {r['peak_rise_mib']:14.1f} "
              f"{r['partition_mib']:14.1f} {r['one_unit_mib']:13.1f} "
              f"{r['full_model_fp32_mib']:14.1f} {r['peak_over_partition_plus_unit']:17.3f}")
    path = Path(__file__).parent / "results" / "zero3_init_memory.json"
    path.write_text(json.dumps({"model": {"layers": LAYERS, "hidden": HIDDEN, "vocab": VOCAB,
                                          "seq": SEQ, "dtype": "bf16", "dp": DP},
                                "rows": rows}, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
