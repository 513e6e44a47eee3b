"""A save killed at any file, or failing on a full disk, leaves the previous checkpoint loadable,
resuming with the same losses; leftover temporaries are removed by the next successful save."""

from __future__ import annotations

import os

from megazero.checkpoint import Writer, read_tracker
from megazero.errors import CheckpointError, expected_errors
from megazero.testing.distributed import run_distributed
from megazero.testing.faults import CrashingWriter, FailingWriter, SimulatedCrash
from megazero.testing.training_runs import TINY, train_in_rank

# One process writes, in this order:
SAVE_FILES = ["mp_rank_00_000_000/model_000.pt", "mp_rank_00_000_000/optim_000.pt",
              "mp_rank_00_000_000/optim_rng.pt", "config.json", "metadata.json",
              "latest_checkpointed_iteration.txt"]
FILES_PER_SAVE = len(SAVE_FILES)


def _every_position(rank, world, tmp):
    base = [*TINY, "--save-interval", "2", "--zero-stage", "1", "--num-layers", "2",
            "--global-batch-size", "4", "--train-iters", "5"]
    every = Writer()
    ref = train_in_rank(rank, world, [*base, "--save", os.path.join(tmp, "ref")], every)
    written = [os.path.relpath(p, os.path.join(tmp, "ref")) for p in every.written]
    out = []
    for k in range(1, FILES_PER_SAVE + 1):
        for leave_tmp in (False, True) if k in (1, FILES_PER_SAVE) else (False,):
            ck = os.path.join(tmp, f"ck{k}{'t' if leave_tmp else ''}")
            # The first save (iteration 2) completes; the one at iteration 4 dies at file k.
            writer = CrashingWriter(FILES_PER_SAVE + k, leave_tmp=leave_tmp)
            try:
                train_in_rank(rank, world, [*base, "--save", ck], writer)
                raise AssertionError("the save did not crash")
            except SimulatedCrash:
                pass
            latest = read_tracker(ck)
            tmp_left = [f for _, _, fs in os.walk(ck) for f in fs if ".tmp." in f]
            resumed = train_in_rank(rank, world, [*base, "--save", ck, "--load", ck])
            tmp_after = [f for _, _, fs in os.walk(ck) for f in fs if ".tmp." in f]
            out.append((k, leave_tmp, latest, resumed, bool(tmp_left), tmp_after))
    return ref, written, out


def test_crash_at_every_file_then_resume(tmp_path):
    [(ref, written, out)] = run_distributed(_every_position, 1, str(tmp_path), timeout=300)
    # Every file of a save is a crash position: saves at 2, 4 and the final one at 5.
    assert written == [os.path.join(f"iter_{it:07d}", f) if f != SAVE_FILES[-1] else f
                       for it in (2, 4, 5) for f in SAVE_FILES], written
    assert sorted(ref) == list(range(1, 6)) and len(out) == FILES_PER_SAVE + 2
    for k, leave_tmp, latest, resumed, had_tmp, tmp_after in out:
        # Until "latest" is rewritten (the last file), the previous checkpoint is the latest.
        assert latest == (4 if k == FILES_PER_SAVE and not leave_tmp else 2), (k, leave_tmp)
        assert sorted(resumed) == list(range(latest + 1, 6))
        for it, loss in resumed.items():
            assert loss == ref[it], (k, leave_tmp, it, loss, ref[it])  # exact: same layout
        assert had_tmp == leave_tmp
        assert tmp_after == [], tmp_after  # the later complete saves removed the debris


# dp=2, ZeRO-1: rank 0 writes the six files above, rank 1 the three of mp_rank_00_000_001/ (the
# weights and optimizer state of the ranges it owns, its RNG states).
RANK1_FILES = 3
FULL_DISK = {"rank 1's shard": (1, RANK1_FILES + 1), "metadata.json": (0, FILES_PER_SAVE + 5),
             "the tracker": (0, FILES_PER_SAVE + 6)}


def _full_disk(rank, world, tmp):
    base = [*TINY, "--save-interval", "2", "--zero-stage", "1", "--num-layers", "2",
            "--train-iters", "5", "--distributed-timeout-minutes", "0.5"]
    ref = train_in_rank(rank, world, base)
    out = {}
    for what, (who, at) in FULL_DISK.items():
        ck = os.path.join(tmp, what.replace(" ", "_"))
        writer = FailingWriter(at) if rank == who else None  # the save at iteration 4 fails
        try:
            train_in_rank(rank, world, [*base, "--save", ck], writer)
            raise AssertionError("the save did not fail")
        except CheckpointError as e:
            message = str(e)
        latest = read_tracker(ck)
        resumed = train_in_rank(rank, world, [*base, "--save", ck, "--load", ck])
        out[what] = (message, latest, resumed)
    return ref, out


def test_full_disk_during_a_save_is_one_error_and_resumes(tmp_path):
    """A write failing with ENOSPC on one rank stops every rank with the same message (no
    rank waits at a barrier for it), naming the file; the previous checkpoint stays the latest
    and resumes exactly."""
    (ref0, out0), (ref1, out1) = run_distributed(_full_disk, 2, str(tmp_path), timeout=300)
    assert issubclass(CheckpointError, expected_errors())  # printed as one line, exit 2
    for what in FULL_DISK:
        (m0, latest0, resumed0), (m1, latest1, resumed1) = out0[what], out1[what]
        assert m0 == m1, (m0, m1)
        ck = tmp_path / what.replace(" ", "_")
        file = {"rank 1's shard": "iter_0000004/mp_rank_00_000_001/model_000.pt",
                "metadata.json": "iter_0000004/metadata.json",
                "the tracker": "latest_checkpointed_iteration.txt"}[what]
        assert m0 == (f"writing the checkpoint of iteration 4 to {ck / file} failed: No space "
                      f"left on device. The previous checkpoint in {ck} is still the latest; "
                      f"free space or fix the directory and resume with --load {ck}"), m0
        assert latest0 == latest1 == 2, what
        assert sorted(resumed0) == [3, 4, 5]
        for it, loss in resumed0.items():
            assert loss == ref0[it] == resumed1[it], (what, it)
