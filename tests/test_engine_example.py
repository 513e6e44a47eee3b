"""Smoke test: examples/finetune_engine.py under torchrun with 2 ranks, a couple of steps."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def test_finetune_example_runs_and_saves(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(open(os.path.join(REPO, "README.md"), encoding="utf-8").read()[:3000])
    save = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "examples/finetune_engine.py",
           "--deepspeed_config", "examples/ds_config_zero2.json", "--text", str(text),
           "--steps", "2", "--save-dir", str(save), "--save-every", "2", "--backend", "gloo"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) == 2, proc.stdout
    # a fresh 256-way byte model starts near ln(256) = 5.55
    assert all(math.isfinite(x) and abs(x - math.log(256)) < 0.5 for x in losses), losses
    assert (save / "latest").read_text() == "step2"
    assert (save / "step2" / "metadata.json").is_file()
