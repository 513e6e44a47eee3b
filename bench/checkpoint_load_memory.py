"""Peak host memory a rank adds while loading a checkpoint saved at another layout.

Saves at tp2 x dp1 (ZeRO-1, 2 ranks), then loads at the same layout, at another tp (tp1 x dp2,
ZeRO-1), at another tp and pp (tp1 x pp2), at another tp with ZeRO-3 (tp1 x dp2), at another dp
(tp2 x dp2, ZeRO-1, 4 ranks) and at ZeRO-3 with only dp changed (tp2 x dp2, 4 ranks). For each
rank it reports:

- ``shard_bytes``: what the rank must hold after loading: its weights, fp32 masters (where they
  are a separate copy) and Adam moments, from the engine's memory report (gradient buffers are
  left out: loading does not touch them);
- ``anon_peak_rise_bytes``: the rise of the peak *anonymous* resident memory (``RssAnon``,
  sampled every millisecond by a thread) during ``load_checkpoint``: the private memory the load
  allocates. The ratio anon / shard is the figure of merit: the Adam moments the load creates
  are part of it (they exist only once loaded), the weights and masters are not (the model is
  built before);
- ``file_peak_rise_bytes``: the rise of the peak file-backed resident memory (``RssFile``): pages
  of the mmap-read checkpoint files, which the kernel can drop at will;
- ``peak_rise_bytes``: the rise of ``ru_maxrss`` (both kinds; the build before the load has
  already set a high-water mark, so this is what loading needs beyond it).

What the anon rise is made of (fp32, 11.4M parameters): the Adam moments the load creates
(2/3 of the shard at tp2 ZeRO-1 and after a pp change, 1/2 at ZeRO-1 with dp 2), and at dp > 1
the temporaries of the parameter all-gather that ends the load as it ends every optimizer step
(``after_step``: the gloo all-gather of the bucket shards; the persistent units at ZeRO-3).
Without that all-gather the ratios measured 0.50 (ZeRO-1, dp 2) and 0.62-0.65 (ZeRO-3), i.e.
the moments plus a few MiB. The reads themselves allocate only partial rows: weights and
optimizer ranges go from the file's pages into the tensors that keep them.

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


def _rss() -> tuple[int, int]:
    """(RssAnon, RssFile) of this process in bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got.get("RssAnon", 0), got.get("RssFile", 0)


class RssPeak:
    """Peak ``RssAnon`` and ``RssFile`` while the ``with`` block runs (sampled every ms)."""

    def __enter__(self) -> RssPeak:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _take(self) -> None:
        now = _rss()
        self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._take()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def _rank(rank, world, tmp, layout, save):
    from megazero.checkpoint import load_checkpoint
    from megazero.config import load_config
    from megazero.training.builders import ChunkTrackers
    from megazero.training.lifecycle import setup
    from megazero.training.loop import train

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
    with RssPeak() as rss:
        load_checkpoint(tmp, run.topo, models=run.chunks, optimizer=run.engine,
                        scheduler=run.scheduler, zero_stage=run.cfg.zero.stage,
                        rng_tracker=ChunkTrackers(run.chunks))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rep = run.engine.memory_report()["bytes"]
    held = sum(sum(rep[k].values()) for k in ("params", "optimizer"))  # grads left out
    return {"shard_bytes": held, "report": rep, "peak_rise_bytes": after - before,
            "anon_peak_rise_bytes": rss.peak[0] - rss.start[0],
            "file_peak_rise_bytes": rss.peak[1] - rss.start[1]}


def main() -> None:
    from megazero.testing.distributed import run_distributed

    tmp = tempfile.mkdtemp(prefix="ckmem-")
    run_distributed(_rank, 2, tmp, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"],
                    True, timeout=600)
    total = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(tmp) for f in fs)
    print(f"checkpoint on disk: {total / 2**20:.1f} MiB")
    results: dict = {"checkpoint_bytes": total, "layouts": {}}
    print(f"{'load at':28s} {'rank':>4s} {'shard MiB':>9s} {'anon rise MiB':>13s} "
          f"{'anon / shard':>12s} {'file rise MiB':>13s} {'maxrss rise MiB':>15s}")
    tp2 = ["--tensor-model-parallel-size", "2"]
    for name, world, layout in [
            ("tp2 zero1 (same layout)", 2, [*tp2, "--zero-stage", "1"]),
            ("tp1 dp2 zero1 (tp change)", 2, ["--zero-stage", "1"]),
            ("tp1 pp2 zero1 (tp, pp change)", 2, ["--pipeline-model-parallel-size", "2",
                                                  "--zero-stage", "1"]),
            ("tp1 dp2 zero3 (tp change)", 2, ["--zero-stage", "3"]),
            ("tp2 dp2 zero1 (dp change)", 4, [*tp2, "--zero-stage", "1"]),
            ("tp2 dp2 zero3 (zero1 -> 3)", 4, [*tp2, "--zero-stage", "3"])]:
        out = run_distributed(_rank, world, tmp, layout, False, timeout=600)
        results["layouts"][name] = out
        for r, o in enumerate(out):
            o["anon_over_shard"] = o["anon_peak_rise_bytes"] / o["shard_bytes"]
            print(f"{name:28s} {r:4d} {o['shard_bytes'] / 2**20:9.1f} "
                  f"{o['anon_peak_rise_bytes'] / 2**20:13.1f} {o['anon_over_shard']:12.2f} "
                  f"{o['file_peak_rise_bytes'] / 2**20:13.1f} "
                  f"{o['peak_rise_bytes'] / 2**20:15.1f}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        "checkpoint_load_memory.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
