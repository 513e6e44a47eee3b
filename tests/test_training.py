"""The training entry point's wiring: DeepSpeed JSON monitors and scheduler, exits, batching."""

from __future__ import annotations

import re

import pytest
import torch

from megazero.config import ConfigError, load_config
from megazero.testing.launch import TINY, check, read_metrics, run_training
from megazero.training.builders import Batching, get_batch

DS_CONFIG = """{
  // a DeepSpeed config as pasted from a tutorial
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": "auto",
  "steps_per_print": 2,
  "wall_clock_breakdown": true,
  "tensorboard": {"enabled": true, "output_path": "%(out)s/tb", "job_name": "job1"},
  "csv_monitor": {"enabled": true, "output_path": "%(out)s/csv", "job_name": "job1"},
  "wandb": {"enabled": true, "project": "megazero-test"},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                "warmup_num_steps": 4, "warmup_type": "linear"}},
  "zero_optimization": {"stage": 1}
}"""


def _drop(args: list[str], *flags: str) -> list[str]:
    """``args`` without the given ``--flag value`` pairs."""
    out, i = [], 0
    while i < len(args):
        if args[i] in flags:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def test_deepspeed_json_monitors_scheduler_and_breakdown(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(DS_CONFIG % {"out": tmp_path})
    # The JSON scheduler replaces the Megatron lr flags; steps_per_print replaces --log-interval.
    args = _drop(TINY, "--lr", "--lr-warmup-iters", "--lr-decay-style", "--log-interval")
    proc = run_training([*args, "--deepspeed_config", str(ds), "--train-iters", "6",
                         "--log-json", str(tmp_path / "m.jsonl")])
    out = check(proc)
    # steps_per_print drives the log line when --log-interval is not given
    its = [int(x) for x in re.findall(r"iteration\s+(\d+)/", out)]
    assert its == [2, 4, 6]
    lines = [ln for ln in out.splitlines() if "time breakdown (ms per iteration)" in ln]
    assert len(lines) == 3
    for name in ("forward", "backward", "optimizer", "data", "logging", "scheduler"):
        assert f" {name}" in lines[-1], name
    # the loss and exit votes ride in the optimizer step's scalar all-reduce
    assert "loss and exit" not in lines[-1]
    # WarmupLR, linear, stepped after each update: after k updates lr = 1e-3 * (k - 1) / 4
    m = read_metrics(tmp_path / "m.jsonl")
    assert [m[i]["learning-rate"] for i in (2, 4, 6)] == pytest.approx([2.5e-4, 7.5e-4, 1e-3])
    # The breakdown's regions add up to the loop time (interval wall time / iterations).
    for i in (4, 6):
        parts = sum(v for k, v in m[i].items() if k.startswith("time/") and k.endswith("_ms")
                    and k != "time/loop_ms")
        assert parts == pytest.approx(m[i]["time/loop_ms"], rel=0.05)
        assert m[i]["time/accounted"] == pytest.approx(parts / m[i]["time/loop_ms"])
        assert m[i]["time/forward_ms"] > 0 and m[i]["time/backward_ms"] > 0
    assert "wandb package is not installed" in proc.stderr
    rows = (tmp_path / "csv" / "job1" / "lm_loss.csv").read_text().splitlines()
    assert rows[0] == "step,lm loss" and [r.split(",")[0] for r in rows[1:]] == ["2", "4", "6"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "job1"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("learning-rate")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("time/loop_ms")] == [2, 4, 6]


def test_exit_duration_and_train_samples(tmp_path):
    out = check(run_training([*TINY, "--train-samples", "80", "--exit-duration-in-mins",
                              "0.0001", "--log-json", str(tmp_path / "m.jsonl")]))
    assert "exiting at iteration 1: exceeded --exit-duration-in-mins" in out
    assert re.search(r"iteration\s+1/\s+10 \|", out)  # 80 samples / batch 8 = 10 iterations


def test_config_errors_are_reported_without_traceback(tmp_path):
    proc = run_training(["--tensor-model-parallel-size", "3", "--num-attention-heads", "4",
                         *TINY[:2], "--distributed-backend", "gloo"])
    assert proc.returncode == 2
    assert "pretrain_gpt.py: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_batching_and_batch_shift():
    cfg = load_config(["--micro-batch-size", "2", "--global-batch-size", "16",
                       "--train-samples", "100"], world_size=4)
    b = Batching.from_config(cfg, dp=4)
    assert (b.global_batch_size, b.num_microbatches, b.train_iters) == (16, 2, 6)
    with pytest.raises(ConfigError, match="--train-iters"):
        Batching.from_config(load_config([], 1), dp=1)
    batch = get_batch(iter([{"tokens": torch.arange(10).view(2, 5)}]))
    assert batch["tokens"].tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]
    assert batch["labels"].tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    assert load_config(["--lr", "1", "--log-json", "x.jsonl"], 1).logging.log_json == "x.jsonl"
    assert load_config(["--log-json=y"], 1).logging.log_json == "y"


def test_backend_choice_slurm_env_and_seeds():
    import random

    import numpy as np

    from megazero.distributed.device import export_launch
    from megazero.distributed.startup import choose_backend, set_seed

    assert choose_backend(None) == ("nccl" if torch.cuda.is_available() else "gloo")
    assert choose_backend("gloo") == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="nccl needs CUDA"):
            choose_backend("nccl")
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "8(x2)"}
    export_launch(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "5", "16", "1", "8")
    torchrun_env = {"RANK": "3", "SLURM_PROCID": "0"}
    export_launch(torchrun_env)  # torchrun's variables win
    assert torchrun_env["RANK"] == "3"
    set_seed(11, pp_rank=1)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    set_seed(111)  # Megatron's rule: seed + 100 * pp_rank
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_more_processes_than_gpus_is_one_clear_error():
    from megazero.distributed.device import choose_device_index

    with pytest.raises(ConfigError, match=r"8 processes on this node but only 1 visible GPU.*"
                                          r"--nproc_per_node 1.*--distributed-backend gloo"):
        choose_device_index({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "8"}, 1, 1)
    assert choose_device_index({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "2"}, 2, 1) == 1
