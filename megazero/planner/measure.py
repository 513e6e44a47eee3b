"""Run candidate layouts for a few iterations with torchrun on this machine and time them.

Each trial is ``torchrun --standalone --nproc_per_node <world> pretrain_gpt.py <flags>
--mock-data --log-interval 1 --log-json <file>``; the measured step time is the median
``iteration-time`` of the iterations after the first (which includes warm-up). A trial that
fails (non-zero exit, timeout, no timing lines) is reported with its last error line and
ranked after the measured ones.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def trial_argv(flags: list[str], world: int, iters: int, log_json: str) -> list[str]:
    run_flags = [f for f in flags if f != "--offload-optimizer"]
    if "--offload-optimizer" in flags:  # no flag for it: a DeepSpeed JSON with the block
        path = log_json + ".ds.json"
        stage = next(int(f.split("=")[1]) for f in flags if f.startswith("--zero-stage="))
        Path(path).write_text(json.dumps({"zero_optimization": {
            "stage": stage, "offload_optimizer": {"device": "cpu"}}}))
        run_flags = [f for f in run_flags if not f.startswith("--zero-stage")]
        run_flags += ["--deepspeed_config", path]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={world}", str(REPO / "pretrain_gpt.py"),
            *run_flags, "--mock-data", f"--train-iters={iters}", "--log-interval=1",
            "--eval-iters=0", "--eval-interval=0", "--log-json", log_json]


def measure_times(flags: list[str], world: int, iters: int = 4, timeout: float = 300.0
                  ) -> tuple[list[float] | None, str | None]:
    """(every logged ``iteration-time`` of one trial in seconds, or None; error text or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(trial_argv(flags, world, iters, log), capture_output=True,
                                  text=True, timeout=timeout, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        if proc.returncode != 0:
            lines = [x for x in (proc.stderr + proc.stdout).splitlines() if x.strip()]
            err = next((x for x in lines if "Error" in x and "ChildFailedError" not in x),
                       lines[-1] if lines else "")
            return None, f"exit {proc.returncode}: {err.strip()[:200]}"
        rows = [json.loads(x) for x in Path(log).read_text().splitlines() if x.strip()] \
            if os.path.exists(log) else []
        times = [r["iteration-time"] for r in rows if "iteration-time" in r]
        if not times:
            return None, "no iteration-time lines in --log-json output"
        return times, None


def measure_flags(flags: list[str], world: int, iters: int = 4, timeout: float = 300.0
                  ) -> tuple[float | None, str | None]:
    """(median seconds per iteration after the first, or None; error text or None)."""
    times, err = measure_times(flags, world, iters, timeout)
    if times is None:
        return None, err
    if len(times) < 2:
        return None, "no iteration-time after the first (warm-up) one"
    return statistics.median(times[1:]), None


def measure_candidates(cands: list[Any], base: list[str], world: int, iters: int) -> list[Any]:
    """Measure each candidate; return them re-ranked by measured time (failures last)."""
    for c in cands:
        c.measured_s, c.failed = measure_flags(base + c.flags, world, iters)
        if c.failed:
            print(f"trial {c.label} failed: {c.failed}", file=sys.stderr)
    ok = sorted((c for c in cands if c.measured_s is not None), key=lambda c: c.measured_s)
    return ok + [c for c in cands if c.measured_s is None]
