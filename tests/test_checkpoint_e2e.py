"""Through ``pretrain_gpt.py``: a run killed in the middle of writing a checkpoint leaves the
previous one usable; another layout loads; another model shape is one clear error."""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing.distributed import DistributedTestError, run_distributed
from megazero.testing.faults import CrashingWriter
from megazero.testing.launch import TINY, check, run_training
from megazero.testing.training_runs import train_in_rank


def _crash_in_second_save(rank, world, args):
    # One process writes 6 files per checkpoint (model, optimizer, rng, config, marker,
    # latest). The process dies (os._exit) after the first file of iteration 6.
    train_in_rank(rank, world, args, CrashingWriter(7, hard=True))


def test_crash_during_save_then_resume(tmp_path):
    ck = tmp_path / "ck"
    args = [*TINY, "--train-iters", "6", "--save", str(ck), "--save-interval", "3"]
    with pytest.raises(DistributedTestError, match="exit"):
        run_distributed(_crash_in_second_save, 1, args, timeout=120)
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ck / "iter_0000003" / "metadata.json").is_file()
    assert os.path.isfile(ck / "iter_0000006" / "mp_rank_00_000_000" / "model_000.pt")
    assert not (ck / "iter_0000006" / "metadata.json").exists()
    # Resume: loads iteration 3, trains 4..6 and writes a complete iteration 6 over the debris.
    log = tmp_path / "m.jsonl"
    out = check(run_training([*args, "--load", str(ck), "--log-json", str(log)]))
    assert "loaded checkpoint" in out and "at iteration 3" in out
    its = [json.loads(line)["iteration"] for line in open(log)
           if "learning-rate" in json.loads(line)]
    assert its == [4, 5, 6]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (ck / "iter_0000006" / "metadata.json").is_file()


def test_other_layout_loads_other_shape_is_a_clear_error_and_finetune_restarts(tmp_path):
    ck = tmp_path / "ck"
    check(run_training([*TINY, "--train-iters", "2", "--save", str(ck)]))
    out = check(run_training([*TINY, "--train-iters", "3", "--load", str(ck),
                              "--override-opt_param-scheduler",
                              "--tensor-model-parallel-size", "2"], nproc=2))
    assert "loaded checkpoint" in out and "at iteration 2" in out
    assert "random states not restored: saved at tp=1 pp=1 dp=1" in out
    hidden = [a if a != "32" or TINY[i - 1] != "--hidden-size" else "64"
              for i, a in enumerate(TINY)]
    proc = run_training([*hidden, "--train-iters", "4", "--load", str(ck),
                         "--override-opt_param-scheduler"])
    assert proc.returncode == 2
    assert "pretrain_gpt.py: error: checkpoint" in proc.stderr
    assert "--hidden-size is 64 but the checkpoint was saved with 32 (config.json)" \
        in proc.stderr
    assert "Traceback" not in proc.stderr
    # --finetune: weights only, counting restarts at iteration 0 (and the optimizer is fresh).
    log = tmp_path / "ft.jsonl"
    out = check(run_training([*TINY, "--train-iters", "2", "--load", str(ck), "--finetune",
                              "--log-json", str(log)]))
    assert "at iteration 0" in out
    its = [json.loads(line)["iteration"] for line in open(log)
           if "learning-rate" in json.loads(line)]
    assert its == [1, 2]
