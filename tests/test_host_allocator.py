"""CPU training keeps what an iteration frees for the next (``megazero.host_allocator``): a
stage-0 run at dp 2 with glibc's defaults takes thousands of fresh pages per iteration (its
forward ran 5-10% slower for it), with the entry point's tuning a few dozen."""

import json
import subprocess
import sys

import pytest

from megazero.host_allocator import keep_freed_host_memory, reason_to_leave_alone
from megazero.testing.launch import REPO, SCRIPT, TORCHRUN, check, env

# bench/zero_speed.py's model and ZeRO settings, stage 0: the case that showed the faults
BENCH_MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
               "--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "4",
               "--seq-length", "128", "--max-position-embeddings", "128",
               "--micro-batch-size", "4", "--global-batch-size", "8", "--attention-dropout",
               "0", "--hidden-dropout", "0", "--lr", "1e-4", "--clip-grad", "1.0",
               "--train-iters", "10", "--eval-iters", "0", "--log-interval", "100",
               "--distributed-backend", "gloo"]

# Runs pretrain_gpt.py with train_step wrapped to record this process's minor page faults
# after each iteration; rank 0 prints them as JSON at exit.
FAULTS_WRAPPER = r"""
import atexit, json, os, resource, runpy, sys
import megazero.training as training
faults = []
step = training.train_step
def counted(*a, **k):
    out = step(*a, **k)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    return out
training.train_step = counted
if os.environ["RANK"] == "0":
    atexit.register(lambda: print("FAULTS " + json.dumps(faults), flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _faults_per_iteration(tmp_path, extra_env: dict[str, str]) -> float:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0, "overlap_comm": True,
                                                    "reduce_bucket_size": 1000000}}))
    wrapper = tmp_path / "faults.py"
    wrapper.write_text(FAULTS_WRAPPER)
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(wrapper), SCRIPT, *BENCH_MODEL,
         "--deepspeed_config", str(ds)],
        env={**env(), **extra_env}, cwd=REPO, timeout=300, capture_output=True, text=True)
    check(proc)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FAULTS "))
    faults = json.loads(line.split(" ", 1)[1])
    assert len(faults) == 10
    return (faults[-1] - faults[3]) / (len(faults) - 4)  # steady state: iterations 5-10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_cpu_training_reuses_freed_host_memory(tmp_path):
    tuned = _faults_per_iteration(tmp_path, {})
    system = _faults_per_iteration(tmp_path, {"MEGAZERO_HOST_ALLOCATOR": "system"})
    # measured on the 2-core CI-like machine: about 40 with the tuning, 5,900 without
    assert tuned < 600, (tuned, system)
    assert system > 4 * tuned, (tuned, system)


def test_user_choices_leave_the_allocator_alone():
    assert reason_to_leave_alone({}) is None
    assert reason_to_leave_alone({"MEGAZERO_HOST_ALLOCATOR": "system"}) == (
        "MEGAZERO_HOST_ALLOCATOR=system")
    assert reason_to_leave_alone({"MALLOC_TRIM_THRESHOLD_": "0"}) == (
        "MALLOC_TRIM_THRESHOLD_ is set")
    assert reason_to_leave_alone({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == (
        "jemalloc is preloaded")
    assert keep_freed_host_memory({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}) is False
