"""The planner against real runs: --log-memory-phases bytes equal the planner's model-state
bytes; plan_layout ranks, writes the winner, measures the top 2 with torchrun, and explains a
model that fits nowhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megazero.config import load_config
from megazero.planner.model_states import model_state_report
from megazero.planner.shapes import meta_chunks, shape_topology
from megazero.testing.launch import TINY, check, read_metrics, run_training

REPO = Path(__file__).resolve().parent.parent
TOOL = str(REPO / "tools" / "plan_layout.py")


def test_log_memory_phases_match_planner_model_states(tmp_path):
    args = [*TINY, "--zero-stage", "1", "--train-iters", "2", "--log-memory-phases"]
    check(run_training([*args, "--log-json", str(tmp_path / "m.jsonl")]))
    m = read_metrics(tmp_path / "m.jsonl")
    cfg = load_config([a for a in args if a != "--mock-data"] + ["--mock-data"], 1)
    rep = model_state_report(meta_chunks(cfg, shape_topology(cfg.layout())), cfg.zero,
                             cfg.precision, dp=1)
    # CPU: tracked tensor bytes. After the step only model states live; after the first
    # backward the AdamW moments do not exist yet (created by the first step), later they do.
    assert m[1]["mem-after-step"] == m[2]["mem-after-step"] == rep.total("device")
    assert m[2]["mem-after-backward"] == rep.total("device")
    assert m[1]["mem-after-backward"] == rep.total("device") - rep.bytes["optimizer"]["device"]
    for it in (1, 2):  # plus the saved activations at their peak
        assert m[it]["mem-after-forward"] > m[it]["mem-after-backward"]


def _plan(args, timeout=600):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def test_plan_layout_measures_top2_and_writes_winner(tmp_path):
    model = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--vocab-size 128 --tokenizer-type NullTokenizer").split()
    proc = _plan([*model, "--world-size", "1", "--cluster", "cpu", "--global-batch-size", "4",
                  "--top", "3", "--measure", "2", "--measure-iters", "2",
                  "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and "winner" in rows[0]
    assert rows[0].split()[-2].endswith("*") or "*" in rows[0]  # measured time marked
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 4 and "zero_optimization" in ds
    flags = (tmp_path / "winner_flags.txt").read_text().split()
    assert load_config([f for f in flags if f != "ds_config.json" and f != "--deepspeed_config"],
                       1).train.global_batch_size == 4


def test_plan_layout_model_that_fits_nowhere():
    proc = _plan(["--model", "gpt2-1.3b", "--world-size", "1", "--cluster", "cpu",
                  "--global-batch-size", "1", "--bf16"])
    assert proc.returncode == 3
    assert "does not fit" in proc.stderr and "The closest is" in proc.stderr
    assert "GB per device" in proc.stderr


def test_plan_layout_impossible_flags_get_the_runs_message():
    proc = _plan(["--model", "llama2-7b", "--world-size", "6", "--cluster", "cpu",
                  "--tensor-model-parallel-size", "4"])
    assert proc.returncode == 2
    assert "not divisible by --tensor-model-parallel-size 4" in proc.stderr or \
        "world size 6 is not divisible" in proc.stderr


def test_planner_and_estimator_agree_and_say_what_they_assume(tmp_path):
    """The winner's flags, given to estimate_memory.py, predict the step time plan_layout.py
    printed for it (one step-time model; the planner does not switch overlap_comm on behind
    the user's back); both print the batch and sequence they assume; --vocab-size from a model
    preset is not among the winner's flags for a real corpus."""
    proc = _plan(["--model", "gpt2-350m", "--world-size", "8", "--bf16", "--top", "1",
                  "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("assuming sequence length 2048, micro-batch 1, global batch 8 (default: the world "
            "size; --global-batch-size)") in proc.stdout, proc.stdout
    row = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("1 ")][0]
    planned = float(row.split()[-3])
    why = [ln for ln in proc.stdout.splitlines() if "beats the runner-up (" in ln]
    assert len(why) == 1 and "tokens/s)" in why[0] and ": it saves " in why[0], proc.stdout
    flags = (tmp_path / "winner_flags.txt").read_text().split()
    assert "--vocab-size" not in flags
    flags[flags.index("ds_config.json")] = str(tmp_path / "ds_config.json")
    est = subprocess.run([sys.executable, str(REPO / "tools" / "estimate_memory.py"), *flags,
                          "--world-size", "8", "--vocab-size", "50257"], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert est.returncode == 0, est.stderr[-3000:]
    assert "assuming sequence length 2048, micro-batch 1, global batch 8" in est.stdout
    estimated = float(est.stdout.split("step time ")[1].split()[0])
    assert abs(estimated - planned) < 1e-3, (estimated, planned)
    assert "(alternatives, not a sum)" in est.stdout and "<- the peak" in est.stdout


def test_plans_read_the_config_as_the_run_on_the_cluster_would():
    """A GPU cluster's runs use NCCL, whose defaults (Megatron's overlap, 40M buckets) differ
    from gloo's: a plan made on this CPU machine takes the cluster's, unless the flags choose."""
    from megazero.planner.cluster import load_cluster, planning_argv

    base = [*TINY[:TINY.index("--distributed-backend")], "--train-iters", "2"]
    gpu = load_config(planning_argv(base, load_cluster("h100-80gb-nvlink")), 1)
    cpu = load_config(planning_argv(base, load_cluster("cpu")), 1)
    assert gpu.zero.overlap_comm and not cpu.zero.overlap_comm
    chosen = planning_argv([*base, "--distributed-backend", "gloo"],
                           load_cluster("h100-80gb-nvlink"))
    assert not load_config(chosen, 1).zero.overlap_comm
