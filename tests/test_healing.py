"""Jobs that heal: a save killed at any moment leaves the previous checkpoint latest and whole; a
job under ``torchrun --max-restarts`` resumes by itself; a restart at another world size keeps
the global batch; a loss that stays exploded stops the run; and what start-up may delete.

Kill trials run in spawned one-rank worlds (a SIGKILL there is a death the harness reports):
each kills the process at one moment of the asynchronous save of iteration 4, from before the
first file is visible to between ``metadata.json`` and the tracker. The tracker must still name
iteration 2, whose files all pass their checksums, and a resume from it must give the
uninterrupted run's losses bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megazero.checkpoint.files import SAVE_IN_PROGRESS, verify
from megazero.checkpoint.reader import MARKER, meta_digest
from megazero.testing.distributed import DistributedTestError, run_distributed
from megazero.testing.healing_runs import KILL_RANK_WRAPPER, kill_at_commit
from megazero.testing.launch import SCRIPT, TINY, TORCHRUN, check, env, read_metrics, run_training
from megazero.testing.training_runs import TINY as TINY_IN_RANK
from megazero.testing.training_runs import train_in_rank

REPO = os.path.dirname(SCRIPT)
RESUMABLE = [*TINY, "--lr-decay-iters", "100"]  # a schedule that a longer run keeps
ASYNC = ["--train-iters", "6", "--save-interval", "2", "--async-save"]
#: (commit number, before its rename) for the save of iteration 4 at one rank, ZeRO 0: the
#: rank's three files (model, optimizer, random states), config.json, metadata.json, tracker
KILL_POINTS = [(n, before) for n in range(1, 7) for before in (True, False)][:-1]


def _killed_rank(rank, world, ck, point):
    kill_at_commit(4, *point)
    return train_in_rank(rank, world, [*TINY_IN_RANK, *ASYNC, "--save", ck])


def _resume_rank(rank, world, args):
    return train_in_rank(rank, world, [*TINY_IN_RANK, *args])


def _intact(ck: str, iteration: int) -> None:
    directory = os.path.join(ck, f"iter_{iteration:07d}")
    meta = json.load(open(os.path.join(directory, MARKER)))
    assert meta["sha256"] == meta_digest(meta)
    for rel, expected in meta["files"].items():
        verify(os.path.join(directory, rel), expected)


def test_a_save_killed_at_any_moment_leaves_the_previous_checkpoint(tmp_path):
    reference = run_distributed(_resume_rank, 1, [*ASYNC, "--save", str(tmp_path / "ref")],
                                timeout=300)[0]
    for point in KILL_POINTS:
        ck = str(tmp_path / f"ck-{point[0]}-{point[1]}")
        with pytest.raises(DistributedTestError, match="died"):
            run_distributed(_killed_rank, 1, ck, point, timeout=300)
        assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "2", point
        _intact(ck, 2)
        unfinished = os.path.join(ck, "iter_0000004")
        if not os.path.exists(os.path.join(unfinished, MARKER)):  # before metadata.json
            assert os.path.exists(os.path.join(unfinished, SAVE_IN_PROGRESS)), point
    # the kill between metadata.json and the tracker, resumed: start-up keeps the complete
    # directory, and the run continues from iteration 2 exactly as the uninterrupted one did
    resumed = run_distributed(_resume_rank, 1, [*ASYNC, "--save", ck, "--load", ck],
                              timeout=300)[0]
    assert sorted(resumed) == [3, 4, 5, 6]
    assert all(resumed[i] == reference[i] for i in resumed), (resumed, reference)
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "6"


def test_a_killed_job_resumes_by_itself_under_max_restarts(tmp_path):
    """Rank 1 of 2 is killed while the save of iteration 4 may be in flight; the next attempt
    starts on the same launcher store, finds the newest complete checkpoint in --save (no
    --load given) and says where it resumes and why. Without attempts kept apart in the store,
    the restarted ranks read the dead attempt's addresses and fail at once."""
    ck = tmp_path / "ck"
    wrapper = tmp_path / "kill.py"
    wrapper.write_text(KILL_RANK_WRAPPER)
    args = [*TINY, *ASYNC, "--save", str(ck), "--log-json", str(tmp_path / "a.jsonl")]
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", "--max-restarts",
                           "1", str(wrapper), SCRIPT, *args], cwd=REPO, timeout=400,
                          env={**env(), "KILL_RANK": "1", "KILL_AT": "5"},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "> restart 1 of this job (torchrun --max-restarts)" in proc.stdout, proc.stdout
    assert "rank 1 (pid" in proc.stdout and "has died" in proc.stdout, proc.stdout[-3000:]
    assert f"> resuming from the newest complete checkpoint in --save {ck}" in proc.stdout
    again = check(run_training([*TINY, *ASYNC, "--save", str(tmp_path / "ref"),
                                "--log-json", str(tmp_path / "b.jsonl")], nproc=2))
    assert again
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    for it in range(1, 7):
        assert a[it]["lm loss"] == b[it]["lm loss"], it
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_a_restart_at_half_the_ranks_keeps_the_global_batch(tmp_path):
    """Saved at 4 ranks with the global batch derived (micro 2 x dp 4 = 8); resumed at 2 ranks
    without --global-batch-size: the batch stays 8 (two micro-batches per rank), and the losses
    are those of a 2-rank resume that asks for 8. At 3 ranks 8 cannot be split: one line."""
    ck = str(tmp_path / "ck")
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--lr", "3e-3",
            "--lr-decay-iters", "100", "--log-interval", "1", "--eval-iters", "0",
            "--distributed-backend", "gloo", "--seed", "7"]
    check(run_training([*base, "--train-iters", "2", "--save", ck], nproc=4))
    logs = {}
    for name, extra in (("kept", []), ("asked", ["--global-batch-size", "8"])):
        out = check(run_training([*base, "--train-iters", "4", "--load", ck, *extra,
                                  "--log-json", str(tmp_path / f"{name}.jsonl")], nproc=2))
        logs[name] = (out, read_metrics(tmp_path / f"{name}.jsonl"))
    out, kept = logs["kept"]
    assert ("> resuming at data-parallel size 2: the global batch stays the checkpoint's 8 "
            "(2 micro-batches of 2 per rank)") in out, out
    assert sorted(kept) == [3, 4] and all(r["batch-size"] == 8 for r in kept.values()), kept
    assert all(kept[i]["lm loss"] == logs["asked"][1][i]["lm loss"] for i in kept)
    assert kept[4]["consumed_samples"] == 32
    bad = run_training([*base, "--train-iters", "4", "--load", ck], nproc=3)
    assert bad.returncode != 0, bad.stderr[-2000:]
    assert ("\n" + bad.stderr).count("\npretrain_gpt.py: error: ") == 1, bad.stderr[-3000:]
    assert "trained with a global batch of 8 samples, which cannot be split into " \
           "micro-batches of 2 over this run's data-parallel size 3" in bad.stderr
    assert "megazero/" not in bad.stderr  # no rank's traceback (torchrun prints its own)


def test_a_finite_divergence_stops_naming_the_checkpoint_to_go_back_to(tmp_path):
    """A learning rate of 5 with clipping keeps the loss finite but at 4e2-2e3 for good: the
    run stops with status 3 after --max-spike-steps spiked steps, naming the last sound
    checkpoint, instead of training on and saving nothing."""
    ck = str(tmp_path / "ck")
    check(run_training([*TINY, "--train-iters", "4", "--save", ck]))
    proc = run_training([*TINY, "--train-iters", "40", "--save", ck, "--load", ck,
                         "--save-interval", "2", "--lr", "5", "--clip-grad", "0.1",
                         "--override-opt_param-scheduler", "--max-spike-steps", "5"])
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stderr.count("pretrain_gpt.py: error: training diverged at iteration") == 1
    assert "5 spiked iterations in a row (--max-spike-steps 5); the run began to diverge at " \
           "iteration 6 (loss " in proc.stderr, proc.stderr
    assert f"the newest checkpoint saved before it is iteration 4 in {ck}" in proc.stderr
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "4"


def test_start_up_deletes_only_its_own_unfinished_saves(tmp_path):
    """A complete checkpoint whose metadata.json is gone (deleted by accident, a copy still in
    progress) is refused in one line naming it, never deleted, also when --load is --save."""
    ck = str(tmp_path / "ck")
    check(run_training([*TINY, "--train-iters", "4", "--save-interval", "2", "--save", ck]))
    gone = os.path.join(ck, "iter_0000004")
    os.remove(os.path.join(gone, MARKER))
    files = sorted(os.listdir(os.path.join(gone, "mp_rank_00_000_000")))
    proc = run_training([*TINY, "--train-iters", "4", "--save", ck, "--load", ck])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{gone} has no metadata.json" in proc.stderr and "Move the folder out" in proc.stderr
    assert sorted(os.listdir(os.path.join(gone, "mp_rank_00_000_000"))) == files


def test_an_index_that_does_not_match_its_files_is_one_line(tmp_path):
    """metadata.json edited (its own checksum recomputed): ranges that overlap, or a range said
    to be in a file that does not hold it. Every rank stops with one line naming the file."""
    ck = str(tmp_path / "ck")
    check(run_training([*RESUMABLE, "--train-iters", "2", "--save", ck]))
    path = os.path.join(ck, "iter_0000002", MARKER)
    original = open(path).read()
    name = "embedding.word_embeddings.weight"
    for fault in ("overlap", "wrong file"):
        meta = json.loads(original)
        ranges = meta["tensors"][name]["ranges"]["weight"][0]
        if fault == "overlap":
            ranges.append([ranges[0][0], 0, 8])
        else:
            other = meta["tensors"]["decoder.final_layernorm.weight"]["ranges"]["optim"][0][0][0]
            ranges[0][0] = other  # an optimizer file: no weights of this tensor there
        meta["sha256"] = meta_digest(meta)
        json.dump(meta, open(path, "w"))
        proc = run_training([*RESUMABLE, "--train-iters", "4", "--load", ck])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (fault, proc.stderr)
        assert "KeyError" not in proc.stderr and "Traceback" not in proc.stderr
        want = (f"{os.path.join(ck, 'iter_0000002')}/{MARKER}: the saved ranges of {name}"
                if fault == "overlap" else f"checkpoint file {os.path.join(ck, 'iter_0000002')}")
        assert want in proc.stderr, (fault, proc.stderr)

