"""On a GPU machine: the breakdown's CUDA-event timers and tools/check_cluster.py on one GPU.
Marked ``gpu`` and skipped where torch sees no CUDA device (as tests/test_gpu.py)."""

import subprocess
import sys
import time

import pytest
import torch

from megazero.observability.timers import Timers
from megazero.testing.launch import REPO, env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_event_timers_time_the_kernels_without_waiting_for_them():
    device = torch.device("cuda", 0)
    t = Timers(device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with t.region("backward"):
        with t.region("forward"):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time at 2 GHz
    host = time.perf_counter() - t0
    got = t.pop_all()  # waits here, once
    assert got["forward"] > 0.02 and got["forward"] > 5 * host, (got, host)
    assert got["backward"] < got["forward"]


def test_check_cluster_on_one_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/check_cluster.py", "--size", "8", "--train-iters", "2",
         "--workdir", str(tmp_path / "cc")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "device binding" in proc.stdout and "zero-3 bf16 save+resume" in proc.stdout
    assert "checks, all passed" in proc.stdout
