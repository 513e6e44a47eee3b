"""CPU training keeps what an iteration frees for the next
(``megazero.distributed.host_allocator``).

What the tuning does to glibc is checked directly (a fresh process's large blocks come from the
heap and stay there when freed). What it does to training is measured in page faults: a stage-0
run at dp 2 with the entry point's tuning takes a few dozen to a couple of hundred fresh pages per
iteration. With glibc's defaults the count depends on what the process happened to free before
(the threshold adapts): 2,000-5,900 in most runs here, about 2 in some, so the defaults are not
held to a number."""

import ctypes
import json
import subprocess
import sys

import pytest

from megazero.distributed.host_allocator import (
    OTHER_ALLOCATORS,
    USER_TUNING,
    keep_freed_host_memory,
    reason_to_leave_alone,
)
from megazero.testing.launch import REPO, SCRIPT, TORCHRUN, check, env

# bench/zero_speed.py's model and ZeRO settings, stage 0: the case that showed the faults
BENCH_MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
               "--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "4",
               "--seq-length", "128", "--max-position-embeddings", "128",
               "--micro-batch-size", "4", "--global-batch-size", "8", "--attention-dropout",
               "0", "--hidden-dropout", "0", "--lr", "1e-4", "--clip-grad", "1.0",
               "--train-iters", "10", "--eval-iters", "0", "--log-interval", "100",
               "--distributed-backend", "gloo"]

# Mallocs eight 4 MiB blocks in a fresh process (tuned or not), frees them, and prints glibc's
# own account (mallinfo2) before, while held, and after.
MALLINFO_PROBE = r"""
import ctypes, json, sys
from megazero.distributed.host_allocator import keep_freed_host_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
tuned = keep_freed_host_memory() if sys.argv[1] == "tuned" else False
def account():
    m = libc.mallinfo2()
    return {"mmapped_blocks": m.hblks, "heap_bytes": m.arena}
before = account()
blocks = [libc.malloc(4 << 20) for _ in range(8)]
held = account()
for b in reversed(blocks):
    libc.free(b)
print(json.dumps({"tuned": tuned, "before": before, "held": held, "freed": account()}))
"""

# Runs pretrain_gpt.py with train_step wrapped to record this process's minor page faults
# after each iteration, and the entry point's tuning call wrapped to record what it returned;
# rank 0 prints both as JSON at exit.
FAULTS_WRAPPER = r"""
import atexit, json, os, resource, runpy, sys
import megazero.distributed.startup as startup
import megazero.training.loop as training
faults, tuned = [], []
step = training.train_step
def counted(*a, **k):
    out = step(*a, **k)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    return out
training.train_step = counted
tune = startup.keep_freed_host_memory
def recorded(*a, **k):
    tuned.append(tune(*a, **k))
    return tuned[-1]
startup.keep_freed_host_memory = recorded
if os.environ["RANK"] == "0":
    atexit.register(lambda: print("FAULTS " + json.dumps({"faults": faults, "tuned": tuned}),
                                  flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _hermetic_env(extra_env: dict[str, str]) -> dict[str, str]:
    """The children's environment without the machine's own allocator choices (a MALLOC_*
    variable, GLIBC_TUNABLES, a preloaded jemalloc/tcmalloc), which would make the tuning step
    aside in both runs."""
    e = {k: v for k, v in env().items() if k not in USER_TUNING}
    preload = [lib for lib in e.pop("LD_PRELOAD", "").replace(":", " ").split()
               if not any(name in lib for name in OTHER_ALLOCATORS)]
    if preload:
        e["LD_PRELOAD"] = " ".join(preload)
    return {**e, **extra_env}


def _without_transparent_huge_pages() -> None:
    """Child setup: count faults in 4 KiB pages whatever the kernel's THP mode. Under
    ``transparent_hugepage=always`` one fault maps 2 MiB and the fresh pages the defaults cost
    show up as a handful of faults. The flag is inherited across fork and exec."""
    pr_set_thp_disable = 41
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_thp_disable, 1, 0, 0, 0)


def _faults_per_iteration(tmp_path, extra_env: dict[str, str]) -> tuple[float, list[bool]]:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0, "overlap_comm": True,
                                                    "reduce_bucket_size": 1000000}}))
    wrapper = tmp_path / "faults.py"
    wrapper.write_text(FAULTS_WRAPPER)
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(wrapper), SCRIPT, *BENCH_MODEL,
         "--deepspeed_config", str(ds)],
        env=_hermetic_env(extra_env), cwd=REPO, timeout=300, capture_output=True, text=True,
        preexec_fn=_without_transparent_huge_pages)
    check(proc)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FAULTS "))
    record = json.loads(line.split(" ", 1)[1])
    faults = record["faults"]
    assert len(faults) == 10
    # steady state: iterations 5-10
    return (faults[-1] - faults[3]) / (len(faults) - 4), record["tuned"]


def _mallinfo(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", MALLINFO_PROBE, mode], env=_hermetic_env({}),
                          cwd=REPO, timeout=60, capture_output=True, text=True)
    check(proc)
    return json.loads(proc.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_tuning_keeps_large_blocks_in_the_heap():
    tuned, system = _mallinfo("tuned"), _mallinfo("system")
    mib32 = 32 << 20
    assert tuned["tuned"] is True, tuned
    # tuned: the 4 MiB blocks come from the heap (mmap threshold 32 MiB) ...
    assert tuned["held"]["mmapped_blocks"] == tuned["before"]["mmapped_blocks"], tuned
    assert tuned["held"]["heap_bytes"] >= tuned["before"]["heap_bytes"] + mib32, tuned
    # ... and stay there once freed (trim threshold 1 GiB)
    assert tuned["freed"]["heap_bytes"] == tuned["held"]["heap_bytes"], tuned
    # glibc's defaults in a fresh process: each one is mmap'd, and unmapped at free
    assert system["held"]["mmapped_blocks"] == system["before"]["mmapped_blocks"] + 8, system
    assert system["freed"] == system["before"], system


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_cpu_training_reuses_freed_host_memory(tmp_path):
    tuned, tuned_calls = _faults_per_iteration(tmp_path, {})
    system, system_calls = _faults_per_iteration(tmp_path, {"MEGAZERO_HOST_ALLOCATOR": "system"})
    # the entry point tunes a CPU run once, and steps aside when the user chose the allocator
    assert tuned_calls == [True] and system_calls == [False], (tuned_calls, system_calls)
    # measured on the 2-core CI-like machine: 1-210 with the tuning (defaults: see the docstring)
    assert tuned < 600, (tuned, system)


def test_user_choices_leave_the_allocator_alone():
    assert reason_to_leave_alone({}) is None
    assert reason_to_leave_alone({"MEGAZERO_HOST_ALLOCATOR": "system"}) == (
        "MEGAZERO_HOST_ALLOCATOR=system")
    assert reason_to_leave_alone({"MALLOC_TRIM_THRESHOLD_": "0"}) == (
        "MALLOC_TRIM_THRESHOLD_ is set")
    assert reason_to_leave_alone({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == (
        "jemalloc is preloaded")
    assert keep_freed_host_memory({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}) is False
