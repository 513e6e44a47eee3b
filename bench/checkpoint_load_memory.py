"""Peak host memory a rank adds while loading a checkpoint saved at another layout.

Saves at tp2 (ZeRO-1, 2 ranks), then loads into tp1 x dp2 at ZeRO-3 and ZeRO-1, into tp1 x pp2,
and into tp2 ZeRO-1 (same layout), and reports per rank: its shard (the bytes of params and
fp32 optimizer state it holds after the load, from the engine's memory report; Adam's moments
exist only once loaded) and the rise of its peak RSS during ``load_checkpoint`` (``ru_maxrss``;
the build before it has already set a high-water mark, so the rise is what loading needs beyond
that; pages of the mmap-read checkpoint files count while resident), and the rise of the peak
*anonymous* resident memory (``RssAnon``, sampled every millisecond by a thread: the memory the
load allocates, without the file pages the kernel can drop at will).
Run: ``python bench/checkpoint_load_memory.py``; writes bench/results/checkpoint_load_memory.json.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
         "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1000"]


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """Peak ``RssAnon`` while the ``with`` block runs (sampled every millisecond)."""

    def __enter__(self) -> AnonPeak:
        self.start = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _rank(rank, world, tmp, layout, save):
    from megazero.checkpointing import load_checkpoint
    from megazero.config import load_config
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
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with AnonPeak() as anon:
        load_checkpoint(tmp, run.topo, models=run.chunks, optimizer=run.engine,
                        scheduler=run.scheduler, zero_stage=run.cfg.zero.stage,
                        rng_tracker=ChunkTrackers(run.chunks))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rep = run.engine.memory_report()["bytes"]
    held = sum(sum(rep[k].values()) for k in ("params", "optimizer"))
    return {"shard_bytes": held, "report": rep, "peak_rise_bytes": after - before,
            "anon_peak_rise_bytes": anon.peak - anon.start}


def main() -> None:
    from megazero.testing.distributed import run_distributed

    tmp = tempfile.mkdtemp(prefix="ckmem-")
    run_distributed(_rank, 2, tmp, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"],
                    True, timeout=600)
    total = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(tmp) for f in fs)
    print(f"checkpoint on disk: {total / 2**20:.1f} MiB")
    results: dict = {"checkpoint_bytes": total, "layouts": {}}
    print(f"{'load at':18s} {'rank':>4s} {'shard MiB':>10s} {'peak RSS rise MiB':>18s} "
          f"{'rise / shard':>12s} {'anon rise MiB':>13s} {'anon / shard':>12s}")
    for name, layout in [("tp2 zero1 (same)", ["--tensor-model-parallel-size", "2",
                                               "--zero-stage", "1"]),
                         ("dp2 zero1", ["--zero-stage", "1"]),
                         ("dp2 zero3", ["--zero-stage", "3"]),
                         ("pp2 zero1", ["--pipeline-model-parallel-size", "2",
                                        "--zero-stage", "1"])]:
        out = run_distributed(_rank, 2, tmp, layout, False, timeout=600)
        results["layouts"][name] = out
        for r, o in enumerate(out):
            print(f"{name:18s} {r:4d} {o['shard_bytes'] / 2**20:10.1f} "
                  f"{o['peak_rise_bytes'] / 2**20:18.1f} "
                  f"{o['peak_rise_bytes'] / o['shard_bytes']:12.2f} "
                  f"{o['anon_peak_rise_bytes'] / 2**20:13.1f} "
                  f"{o['anon_peak_rise_bytes'] / o['shard_bytes']:12.2f}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        "checkpoint_load_memory.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)

if __name__ == "__main__":
    main()
