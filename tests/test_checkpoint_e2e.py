"""A training run killed in the middle of writing a checkpoint leaves the previous one usable."""

from __future__ import annotations

import json
import os

from test_e2e import TINY, check, run_training

from megazero.checkpointing import FAULT_ENV


def test_crash_during_save_then_resume(tmp_path):
    ck = tmp_path / "ck"
    args = [*TINY, "--train-iters", "6", "--save", str(ck), "--save-interval", "3"]
    # One process writes 5 files per checkpoint (model, optimizer shard, config, marker,
    # latest). Dying after the first file of iteration 6: iteration 3 stays the latest.
    proc = run_training(args, extra_env={FAULT_ENV: "1@6"})
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ck / "iter_0000003" / "metadata.json").is_file()
    assert os.path.isfile(ck / "iter_0000006" / "mp_rank_00_000" / "model.pt")
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


def test_other_layout_is_a_clear_error_and_finetune_restarts(tmp_path):
    ck = tmp_path / "ck"
    check(run_training([*TINY, "--train-iters", "2", "--save", str(ck)]))
    proc = run_training([*TINY, "--train-iters", "2", "--load", str(ck),
                         "--tensor-model-parallel-size", "2"], nproc=2)
    assert proc.returncode != 0
    assert "pretrain_gpt.py: error: checkpoint" in proc.stderr
    assert "saved at layout tp=1 pp=1 dp=1 vpp=1 zero_stage=0, but this run is tp=2 pp=1" \
        in proc.stderr
    # --finetune: weights only, counting restarts at iteration 0 (and the optimizer is fresh).
    log = tmp_path / "ft.jsonl"
    out = check(run_training([*TINY, "--train-iters", "2", "--load", str(ck), "--finetune",
                              "--log-json", str(log)]))
    assert "at iteration 0" in out
    its = [json.loads(line)["iteration"] for line in open(log)
           if "learning-rate" in json.loads(line)]
    assert its == [1, 2]
