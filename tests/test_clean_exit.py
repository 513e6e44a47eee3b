"""A rank of ``pretrain_gpt.py`` hands the interpreter's finalization nothing but its main
thread.

A gloo process group runs worker threads. One still alive when the interpreter finalizes may
drop its last work item then, and with it the Python object of a tensor in that item: taking
the GIL during finalization ends the thread by forced unwinding through C++ destructors, and
the process aborts with "terminate called without an active exception" after a run that
trained and saved correctly (seen about 1 run in 20 of a 4-rank job on 2 loaded cores; the
core dump shows ``~AsyncBarrierWork`` -> ``decref_pyobject`` -> ``pthread_exit``). Every group
is therefore destroyed, and its threads joined, before the interpreter starts to finalize:
nothing may keep the engine or the model alive past the run (a gradient hook holding the
optimizer strongly did), ``torch._dynamo`` is imported before the default group exists
(imported after, it keeps the group alive), and after the last barrier ``pretrain`` frees the
run's cycles at once.

The probe wraps the entry point: it lists the process's threads when the groups are destroyed
and before the run is freed (their threads are still there, which shows the probe sees them),
and again in an exit hook that runs after every other one.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero.distributed.topology import ParallelTopology
from megazero.testing import run_distributed
from megazero.testing.launch import REPO, SCRIPT, TINY, TORCHRUN, check, env

PROBE = r"""
import atexit, json, os, runpy, sys

def threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended while listed
            pass
    return sorted(names)

out, script = sys.argv[1], sys.argv[2]
seen = {}
atexit.register(lambda: open(os.path.join(out, os.environ["RANK"] + ".json"), "w").write(
    json.dumps({**seen, "at exit": threads()})))

import megazero.training.pretrain as training
free = training.free_destroyed_groups

def probed_free():
    seen["before clean-up"] = threads()
    free()

training.free_destroyed_groups = probed_free
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


def _probed_pretrain(tmp_path, args: list[str]) -> tuple[subprocess.CompletedProcess,
                                                          list[dict[str, list[str]]]]:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "threads"
    out.mkdir()
    # ZeRO-3 (hooks on every module) x TP 2 x DP 2: the groups of every kind
    layout = ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "4", str(probe),
                           str(out), SCRIPT, *TINY, *layout, *args], env=env(), cwd=REPO,
                          timeout=300, capture_output=True, text=True)
    return proc, [json.loads(f.read_text()) for f in sorted(out.iterdir())]


def test_every_rank_leaves_only_its_main_thread_to_the_interpreter(tmp_path):
    proc, seen = _probed_pretrain(tmp_path, ["--train-iters", "2", "--save",
                                             str(tmp_path / "ckpt"), "--save-interval", "2"])
    check(proc)
    assert len(seen) == 4
    for rank, threads in enumerate(seen):
        assert threads["before clean-up"].count("pt_gloo_runloop") >= 2, threads
        assert len(threads["at exit"]) == 1, (rank, threads["at exit"])


def test_a_run_that_diverged_leaves_only_its_main_thread_too(tmp_path):
    """Every rank stops together (each with exit status 3): an orderly exit, though by an
    error. The first rank to leave with status 3 has torchrun end the others, so only the
    ranks that got to their exit hooks first have a record."""
    proc, seen = _probed_pretrain(tmp_path, ["--train-iters", "12", "--lr", "1e6"])
    assert proc.returncode != 0  # torchrun's own status for a failed worker
    assert "training diverged at iteration" in proc.stderr, proc.stderr[-3000:]
    assert seen
    for rank, threads in enumerate(seen):
        assert threads["before clean-up"].count("pt_gloo_runloop") >= 2, threads
        assert len(threads["at exit"]) == 1, (rank, threads["at exit"])


def test_an_engine_script_leaves_only_its_main_thread_to_the_interpreter(tmp_path):
    """The engine API: megazero.initialize in a user's main(), the process group left by the
    exit hook that ``init_distributed`` armed (barrier, destroy, then the run is freed)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "threads"
    out.mkdir()
    text = tmp_path / "corpus.txt"
    text.write_text(open(f"{REPO}/README.md", encoding="utf-8").read()[:3000])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", str(probe),
                           str(out), f"{REPO}/examples/finetune_engine.py",
                           "--deepspeed_config", f"{REPO}/examples/ds_config_zero2.json",
                           "--text", str(text), "--steps", "2", "--backend", "gloo"],
                          env={**env(), "PYTHONPATH": REPO}, cwd=REPO, timeout=300,
                          capture_output=True, text=True)
    check(proc)
    for rank in range(2):
        seen = json.loads((out / f"{rank}.json").read_text())
        assert len(seen["at exit"]) == 1, (rank, seen["at exit"])


def _gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("pt_gloo_runloop")


def _layout_after_layout(rank, world):
    dist.barrier()  # the default group's threads start on its first collective
    counts = [_gloo_threads()]
    for tp in (2, 1, 2):  # tools/check_cluster.py trains one layout after another
        topo = ParallelTopology.build(tp=tp, timeout=timedelta(minutes=1))
        for kind in topo.groups:
            if topo.groups[kind] is not None:
                dist.all_reduce(torch.ones(1), group=topo.groups[kind])
        counts.append(_gloo_threads())
        topo.destroy_groups()
        assert all(g is None for g in topo.groups.values())
        del topo
        gc.collect()
        counts.append(_settled_gloo_threads(counts[0]))
    return counts


def _settled_gloo_threads(base: int, wait_s: float = 10.0) -> int:
    """The gloo thread count once the destroyed groups' threads have exited: a thread is told
    to stop by its group's destructor and leaves its loop on its own (later on a loaded host),
    so wait up to ``wait_s`` for the count to come down to ``base``."""
    deadline = time.monotonic() + wait_s
    count = _gloo_threads()
    while count > base and time.monotonic() < deadline:
        time.sleep(0.05)
        count = _gloo_threads()
    return count


def test_a_layouts_groups_are_destroyed_before_the_next_layout_makes_its_own():
    """Each layout's groups (here 4 gloo groups, 2 worker threads each) end with it: the
    threads do not pile up over the layouts a process trains in turn."""
    for counts in run_distributed(_layout_after_layout, 2, timeout=120):
        base = counts[0]
        assert all(c >= base + 8 for c in counts[1::2]), counts
        assert all(c == base for c in counts[2::2]), counts
