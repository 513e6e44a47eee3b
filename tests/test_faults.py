"""Faults and divergence: nothing lost, nothing silent.

A NaN/inf step is skipped and never saved; a run that keeps diverging stops with one message
and leaves ``latest`` on the last sound checkpoint, which resumes exactly.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
from contextlib import redirect_stdout
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megazero.checkpoint import read_model_state
from megazero.checkpoint.save_check import checkpoint_bytes, explain_write_error, save_dir_problem
from megazero.config import ConfigError, LoggingConfig, load_config
from megazero.data import token_range
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megazero.observability.monitor import Monitor
from megazero.optim.lr_scheduler import build_lr_function
from megazero.testing.launch import TINY, check, read_metrics, run_training
from megazero.training.run import HISTORY_LENGTH, TrainState


def test_divergence_skips_stops_and_keeps_latest(tmp_path):
    ck, straight, resumed = tmp_path / "ck", tmp_path / "straight.jsonl", tmp_path / "res.jsonl"
    args = [*TINY, "--train-iters", "8", "--save", str(ck)]
    check(run_training([*args, "--save-interval", "4", "--log-json", str(straight)]))
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    # Resume with an absurd learning rate: the weights blow up, the losses turn NaN.
    bad = run_training([*args, "--load", str(ck), "--lr", "1e6",
                            "--override-opt_param-scheduler", "--save-interval", "2",
                        "--train-iters", "14", "--log-json", str(tmp_path / "bad.jsonl")])
    assert bad.returncode == 3, bad.stderr[-3000:]
    assert bad.stderr.count("training diverged at iteration") == 1, bad.stderr[-3000:]
    assert "NaN/inf for 3 iterations in a row (--max-nonfinite-steps 3)" in bad.stderr
    assert "the newest checkpoint saved before it is iteration 4" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "4"
    m = read_metrics(tmp_path / "bad.jsonl")
    nan_its = [i for i, r in m.items() if r["nan"]]
    assert len(nan_its) == 3 and all(m[i]["skipped"] for i in nan_its), m
    # Skipped steps do not advance the schedule: the lr holds still across them.
    assert len({m[i]["learning-rate"] for i in nan_its}) == 1
    # The sound checkpoint resumes with the losses of the uninterrupted run.
    out = check(run_training([*args, "--load", str(ck), "--log-json", str(resumed)]))
    assert "at iteration 4" in out
    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    for it in b:
        assert b[it]["lm loss"] == a[it]["lm loss"], it


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_half_precision_divergence_stops_without_saving_and_resumes(tmp_path, precision):
    """fp32 above; in bf16 and fp16 (whose loss scaler skips overflowing steps on its own) a
    NaN run also ends with exit 3 and one message, and the last finite checkpoint resumes
    exactly: the same flags give the same losses and diverge again at the same iteration."""
    ck = tmp_path / "ck"
    args = [*TINY, precision, "--train-iters", "12", "--lr", "1e6", "--save", str(ck),
            "--save-interval", "1", "--max-nonfinite-steps", "2"]
    proc = run_training([*args, "--log-json", str(tmp_path / "a.jsonl")])
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.count("pretrain_gpt.py: error: training diverged at iteration") == 1
    assert "Traceback" not in proc.stderr
    assert "NaN/inf for 2 iterations in a row (--max-nonfinite-steps 2)" in proc.stderr
    saved = int((ck / "latest_checkpointed_iteration.txt").read_text())
    # The next iteration's state was refused (NaN/inf weights), or saved and then discarded
    # because the step after it spiked (its update is what made the weights explode).
    assert (f"not saving the interval checkpoint at iteration {saved + 1}" in proc.stdout
            or f"discarded the checkpoint of iteration {saved + 1}" in proc.stdout), proc.stdout
    diverged = int(proc.stderr.split("training diverged at iteration ")[1].split(":")[0])
    # Where the instability began: the first iteration of the NaN streak, or an earlier finite
    # spike the message names (bf16 may blow up to a finite 1e12 loss one step before NaN).
    began = diverged - 1
    if "began to diverge at iteration " in proc.stderr:
        began = int(proc.stderr.split("began to diverge at iteration ")[1].split(" ")[0])
        assert began <= diverged - 1
    # The last iteration before it, or the one before that when that iteration's loss was
    # still sound but its update is what blew up (refused or discarded, never kept).
    assert began - 2 <= saved <= began - 1
    _, state = read_model_state(str(ck))
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    again = run_training([*args, "--load", str(ck), "--log-json", str(tmp_path / "b.jsonl")])
    assert again.returncode == 3, again.stderr[-3000:]
    assert f"training diverged at iteration {diverged}:" in again.stderr
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert sorted(b) == list(range(saved + 1, diverged + 1))
    for it in b:
        assert b[it].get("lm loss") == a[it].get("lm loss"), it
        assert b[it]["loss-scale"] == a[it]["loss-scale"] and b[it]["nan"] == a[it]["nan"]


def test_validation_perplexity_of_nan_is_nan():
    mon = Monitor(LoggingConfig(), enabled=True)
    buf = io.StringIO()
    with redirect_stdout(buf):
        mon.report_validation(5, math.nan)
        mon.report_validation(6, 2.0)
    out = buf.getvalue()
    assert "lm loss PPL: NAN |" in out
    assert f"lm loss PPL: {math.exp(2.0):.6E} |" in out


def test_history_is_bounded():
    st = TrainState()
    for i in range(HISTORY_LENGTH + 50):
        st.history.append({"iteration": i + 1})
    assert len(st.history) == HISTORY_LENGTH
    assert st.history[0]["iteration"] == 51 and st.history[-1]["iteration"] == HISTORY_LENGTH + 50


def _corpus(prefix, top_id: int) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as b:
        for i in range(40):
            doc = rng.integers(0, 100, size=30)
            if i == 17:
                doc[5] = top_id
            b.add_document(doc)
        b.finalize()


def test_token_ids_outside_the_vocabulary_stop_before_training(tmp_path):
    _corpus(tmp_path / "corpus", 200)
    args = [a for a in TINY if a != "--mock-data"]
    args = [*args, "--data-path", str(tmp_path / "corpus"), "--train-iters", "2",
            "--data-cache-path", str(tmp_path / "cache")]
    for nproc, layout in ((1, []), (2, ["--tensor-model-parallel-size", "2"])):
        proc = run_training([*args, *layout], nproc=nproc)
        assert proc.returncode != 0, proc.stdout[-2000:]
        err = proc.stderr
        assert (f"--data-path {tmp_path / 'corpus'}: {tmp_path / 'corpus.bin'} holds token id "
                f"200, but the model's vocabulary has 128 tokens") in err, err[-3000:]
        assert "lm loss" not in proc.stdout
        assert "megazero/" not in err  # a message, no worker traceback (torchrun adds its own)


def test_max_token_id_is_cached_with_the_index(tmp_path, monkeypatch):
    _corpus(tmp_path / "c", 99)
    ds = IndexedDataset(str(tmp_path / "c"))
    assert token_range.max_token_id(ds, str(tmp_path / "cache")) == 99
    assert token_range.check_token_ids(ds, 100, str(tmp_path / "cache")) == 99

    def no_scan(_):
        raise AssertionError("scanned the .bin again")

    monkeypatch.setattr(token_range, "_scan_range", no_scan)
    assert token_range.max_token_id(IndexedDataset(str(tmp_path / "c")),
                                    str(tmp_path / "cache")) == 99
    with pytest.raises(ConfigError, match="holds token id 99, but the model's vocabulary has 99"):
        token_range.check_token_ids(ds, 99, str(tmp_path / "cache"))
    _corpus(tmp_path / "c", 150)  # preprocessed again under the same name: a new cache entry
    monkeypatch.undo()
    assert token_range.max_token_id(IndexedDataset(str(tmp_path / "c")),
                                    str(tmp_path / "cache")) == 150


def test_out_of_range_ids_in_any_blended_file_name_that_file_and_the_range(tmp_path):
    """A blend whose second file holds an id past the vocabulary, or a negative id (an int32
    corpus written by another tool): the error names that file and the ids."""
    from megazero.data.builder import DataConfig, build_train_valid_test_datasets
    from megazero.data.indexed_dataset import data_file_path

    _corpus(tmp_path / "good", 99)
    _corpus(tmp_path / "bad", 130)
    with IndexedDatasetBuilder(str(tmp_path / "neg"), np.int32) as b:
        b.add_document(np.arange(10))
        b.finalize()
    with open(data_file_path(str(tmp_path / "neg")), "r+b") as f:  # token 3 becomes -1
        f.seek(3 * 4)
        f.write(np.array([-1], dtype=np.int32).tobytes())

    def build(*prefixes):
        path = [x for p in prefixes for x in ("1", str(tmp_path / p))]
        cfg = DataConfig(data_path=tuple(path), split="98,1,1", seq_length=8,
                         num_samples=(8, 0, 0),
                         seed=1, vocab_size=128, cache_dir=str(tmp_path / "cache"))
        return build_train_valid_test_datasets(cfg, is_builder=True, barrier=lambda: None)

    assert build("good")[0] is not None
    with pytest.raises(ConfigError) as e:
        build("good", "bad")
    assert str(e.value).startswith(f"--data-path {tmp_path / 'bad'}: {tmp_path / 'bad.bin'} "
                                   f"holds token id 130, but the model's vocabulary has 128 "
                                   f"tokens (ids 0..127, ")
    with pytest.raises(ConfigError) as e:
        build("neg", "good")
    assert str(e.value).startswith(f"--data-path {tmp_path / 'neg'}: {tmp_path / 'neg.bin'} "
                                   f"holds token id -1, but token ids run 0..127 (the "
                                   f"tokenizer / --vocab-size); ids -1..9 are in the file")


def test_save_directory_is_checked_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_training([*TINY, "--train-iters", "2", "--save", str(blocker / "ck")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"--save {blocker / 'ck'}: cannot create the checkpoint directory: Not a directory"
            in proc.stderr)
    assert "lm loss" not in proc.stdout
    # Free space: one checkpoint needs the parameter and optimizer bytes of every rank.
    full = SimpleNamespace(free=1000)
    msg = save_dir_problem(str(tmp_path / "ck"), 3 * 2**20, disk_usage=lambda _: full)
    assert msg == (f"--save {tmp_path / 'ck'}: 1000.0 B free on its file system, but one "
                   f"checkpoint of this model needs about 3.0 MB (parameters and optimizer "
                   f"state of all ranks); free some space or point --save elsewhere")
    assert save_dir_problem(str(tmp_path / "ck"), 3 * 2**20) is None
    assert save_dir_problem(str(blocker), 1).startswith(f"--save {blocker} is not a directory")


def test_checkpoint_bytes_and_write_errors_name_path_and_cause(tmp_path):
    engine = SimpleNamespace(memory_report=lambda: {"bytes": {
        "params": {"device": 400, "offload": 0}, "grads": {"device": 400, "offload": 0},
        "optimizer": {"device": 1200, "offload": 8}}})
    assert checkpoint_bytes(engine) == 1608  # grads are not saved
    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ck/iter_0000004/model.pt")
    assert explain_write_error("/ck", 4, err).startswith(
        "writing the checkpoint of iteration 4 to /ck/iter_0000004/model.pt failed: No space "
        "left on device.")
    # torch.save reports a full disk as a RuntimeError without errno: the free space tells.
    err = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
    msg = explain_write_error(str(tmp_path), 4, err, disk_usage=lambda _: SimpleNamespace(free=0))
    assert f"to {tmp_path} failed: No space left on device ([enforce fail" in msg


DROPOUT = [*TINY, "--hidden-dropout", "0.2", "--attention-dropout", "0.2"]


def test_resume_restores_the_dropout_rng_streams(tmp_path):
    """With dropout on, a resumed run draws the same masks as the uninterrupted one only if the
    checkpoint restored every RNG stream (the default generator and the TP tracker's)."""
    ck, straight, resumed = tmp_path / "ck", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = [*DROPOUT, "--train-iters", "6", "--save", str(ck)]
    check(run_training([*args, "--save-interval", "3", "--log-json", str(straight)]))
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    check(run_training([*args, "--load", str(ck), "--log-json", str(resumed)]))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(b) == [4, 5, 6]
    for it in b:
        assert b[it]["lm loss"] == a[it]["lm loss"], it


def test_validation_runs_in_eval_mode(tmp_path):
    """--lr 0 keeps the weights, so the validation loss cannot depend on the dropout rate
    unless dropout is (wrongly) active during evaluation."""
    vals = []
    for rate in ("0.5", "0"):
        log = tmp_path / f"v{rate}.jsonl"
        check(run_training([*TINY, "--lr", "0", "--lr-warmup-iters", "0", "--train-iters", "1",
                            "--eval-iters", "2",
                            "--hidden-dropout", rate, "--attention-dropout", rate,
                            "--log-json", str(log)]))
        recs = [json.loads(line) for line in open(log)]
        vals.append([r["lm loss validation"] for r in recs if "lm loss validation" in r])
    assert len(vals[0]) == 1 and vals[0] == vals[1], vals


def test_lr_schedule_holds_still_on_overflow_skipped_steps(tmp_path):
    """fp16 with a loss scale that overflows at first: the skipped steps do not advance the
    schedule, so iteration i reports lr(number of updates so far)."""
    log = tmp_path / "m.jsonl"
    args = [*TINY, "--fp16", "--initial-loss-scale", str(2 ** 24), "--hysteresis", "1",
            "--train-iters", "8"]
    check(run_training([*args, "--log-json", str(log)]))
    m = read_metrics(log)
    skipped = [m[i]["skipped"] for i in range(1, 9)]
    assert 2 <= sum(skipped) <= 6, skipped  # some overflow, then it trains
    lr_of = build_lr_function(load_config(args).optimizer, 8)
    updates = 0
    for i in range(1, 9):
        updates += 1 - m[i]["skipped"]
        assert m[i]["learning-rate"] == pytest.approx(lr_of(updates), rel=1e-12, abs=0), i
