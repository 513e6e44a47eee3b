"""Peak host memory a rank adds while loading a checkpoint saved at another layout.

Saves at tp2 (ZeRO-1, 2 ranks), then loads into tp1 x dp2 at ZeRO-3 and ZeRO-1, and into
tp2 ZeRO-1 (same layout), and reports per rank: the bytes of model state it holds (params +
optimizer, from the engine's memory report) and the rise of its peak RSS during
``load_checkpoint`` (``ru_maxrss``; the build before it has already set a high-water mark, so
the rise is what loading needs beyond that). Run: ``python bench/checkpoint_load_memory.py``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
         "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1000"]


def _rank(rank, world, tmp, layout, save):
    from megazero.arguments import load_config
    from megazero.checkpointing import load_checkpoint
    from megazero.train_setup import ChunkTrackers
    from megazero.training import setup, train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    if save:
        run = setup(load_config([*MODEL, *layout, "--train-iters", "1", "--save", tmp], world))
        train(run)
        run.monitor.close()
        return None
    run = setup(load_config([*MODEL, *layout, "--train-iters", "1"], world))
    run.monitor.close()
    rep = run.engine.memory_report()
    held = sum(v for k, v in rep.items() if k.endswith("bytes") and isinstance(v, int)
               and k.split("_")[0] in ("params", "optimizer"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load_checkpoint(tmp, run.topo, models=run.chunks, optimizer=run.engine,
                    scheduler=run.scheduler, zero_stage=run.cfg.zero.stage,
                    rng_tracker=ChunkTrackers(run.chunks))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"held_bytes": held, "report": rep, "peak_rise_bytes": after - before}


def main() -> None:
    from megazero.testing.distributed import run_distributed

    tmp = tempfile.mkdtemp(prefix="ckmem-")
    run_distributed(_rank, 2, tmp, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"],
                    True, timeout=600)
    total = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(tmp) for f in fs)
    print(f"checkpoint on disk: {total / 2**20:.1f} MiB")
    results = {}
    for name, layout in [("tp2 zero1 (same)", ["--tensor-model-parallel-size", "2",
                                               "--zero-stage", "1"]),
                         ("dp2 zero1", ["--zero-stage", "1"]),
                         ("dp2 zero3", ["--zero-stage", "3"])]:
        out = run_distributed(_rank, 2, tmp, layout, False, timeout=600)
        results[name] = out
        for r, o in enumerate(out):
            print(f"{name:18s} rank {r}: report {json.dumps(o['report'])[:160]} | "
                  f"peak RSS rise while loading {o['peak_rise_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
