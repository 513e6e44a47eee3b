"""Training time lost to a checkpoint save, synchronous against ``--async-save``, and the host
memory each adds.

One rank (gloo, CPU) trains a GPT whose parameters and Adam state are about 250 MB (fp32: a
32000 x 512 embedding and 4 layers of hidden 512), saving every ``INTERVAL`` iterations, three
ways in fresh processes: no save (the reference), synchronous saves, asynchronous saves. The end
of every iteration is timed (a wrapper around the training step). For each save, the time lost
is the wall time of the ``INTERVAL`` iterations that follow it (the save itself, and whatever
the background writer takes from training until the next save) minus ``INTERVAL`` times the
reference run's median iteration: medians over the ``SAVES`` saves, with the spread. Host
memory: the peak anonymous resident memory (``RssAnon``, sampled every millisecond; files go
through the page cache, which is not counted) above the reference run's, against the rank's
state (the engine's parameter and optimizer bytes).

Run: ``python bench/checkpoint_save_async.py [out.json]``; writes
bench/results/checkpoint_save_async.json by default.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
         "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "4",
         "--lr", "1e-4", "--eval-iters", "0", "--log-interval", "1000", "--bf16",
         "--distributed-backend", "gloo"]
INTERVAL, SAVES = 4, 5
ITERS = INTERVAL * (SAVES + 1)


def child(mode: str, out: str) -> None:
    """One run in this process; writes its iteration end times and memory to ``out``."""
    from bench.checkpoint_load_memory import RssPeak
    from megazero.checkpoint.save_check import checkpoint_bytes
    from megazero.config import load_config
    from megazero.training import loop
    from megazero.training.lifecycle import setup

    tmp = tempfile.mkdtemp(prefix="bench-async-")
    args = [*MODEL, "--train-iters", str(ITERS)]
    if mode != "none":
        args += ["--save", os.path.join(tmp, "ck"), "--save-interval", str(INTERVAL)]
    if mode == "async":
        args.append("--async-save")
    run = setup(load_config(args, 1))
    ends: list[float] = []
    step = loop.train_step

    def timed(*a, **k):
        result = step(*a, **k)
        ends.append(time.perf_counter())
        return result

    loop.train_step = timed
    with RssPeak() as rss:
        loop.train(run)
    run.close()
    json.dump({"ends": ends, "anon_start": rss.start[0], "anon_peak": rss.peak[0],
               "state_bytes": checkpoint_bytes(run.engine),
               "staged_bytes": run.saver.peak_staged_bytes if run.saver else 0}, open(out, "w"))


def _run(mode: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, __file__, "--child", mode, out], check=True, env=env)
    return json.load(open(out))


def lost_per_save(ends: list[float], median_iteration: float) -> list[float]:
    """Seconds each save cost training: the ``INTERVAL`` iterations after it against the
    reference's median iteration."""
    out = []
    for k in range(1, SAVES + 1):
        start, end = k * INTERVAL - 1, (k + 1) * INTERVAL - 1  # 0-based end indices
        out.append((ends[end] - ends[start]) - INTERVAL * median_iteration)
    return out


def main(path: str) -> dict:
    runs = {mode: _run(mode) for mode in ("none", "sync", "async")}
    ref = runs["none"]["ends"]
    median_iteration = statistics.median(b - a for a, b in zip(ref, ref[1:]))
    rows = {}
    for mode in ("sync", "async"):
        r = runs[mode]
        lost = lost_per_save(r["ends"], median_iteration)
        extra = r["anon_peak"] - runs["none"]["anon_peak"]
        rows[mode] = {"lost_s_median": statistics.median(lost), "lost_s_min": min(lost),
                      "lost_s_max": max(lost), "lost_s": lost, "extra_host_bytes": extra,
                      "extra_host_vs_state": extra / r["state_bytes"],
                      "state_bytes": r["state_bytes"], "staged_bytes": r["staged_bytes"]}
    ratio = rows["async"]["lost_s_median"] / rows["sync"]["lost_s_median"]
    print(f"median iteration (no save): {median_iteration * 1e3:.1f} ms; rank state "
          f"{rows['sync']['state_bytes'] / 2**20:.0f} MiB; {SAVES} saves every {INTERVAL} "
          f"iterations")
    print(f"{'mode':6s} {'lost per save (median, min-max)':>34s} {'extra host memory':>20s}")
    for mode, r in rows.items():
        print(f"{mode:6s} {r['lost_s_median'] * 1e3:12.1f} ms ({r['lost_s_min'] * 1e3:.1f}-"
              f"{r['lost_s_max'] * 1e3:.1f}) {r['extra_host_bytes'] / 2**20:12.0f} MiB "
              f"({r['extra_host_vs_state']:.2f}x state)")
    print(f"async / sync time lost: {ratio:.3f} (goal <= 0.15); async extra host memory "
          f"{rows['async']['extra_host_vs_state']:.2f}x the state (goal <= 1.0)")
    result = {"median_iteration_s": median_iteration, "interval": INTERVAL, "saves": SAVES,
              "model": MODEL, "rows": rows, "async_over_sync_lost": ratio,
              "machine": f"{os.cpu_count()} CPU cores"}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    json.dump(result, open(path, "w"), indent=1)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        here = os.path.dirname(os.path.abspath(__file__))
        main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
            here, "results", "checkpoint_save_async.json"))
