"""A save killed at any file leaves the previous checkpoint loadable, resuming with the same
losses; leftover temporaries are removed by the next successful save."""

from __future__ import annotations

import os

from ckpt_runs import TINY, train_in_rank

from megazero.checkpointing import read_tracker
from megazero.testing.distributed import run_distributed
from megazero.testing.faults import CrashingWriter, SimulatedCrash

FILES_PER_SAVE = 6  # one process: model.pt, optim.pt, optim_rng.pt, config, metadata, latest


def _every_position(rank, world, tmp):
    base = [*TINY, "--save-interval", "2", "--zero-stage", "1", "--num-layers", "2",
            "--global-batch-size", "4", "--train-iters", "5"]
    ref = train_in_rank(rank, world, base)
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
    return ref, out


def test_crash_at_every_file_then_resume(tmp_path):
    [(ref, out)] = run_distributed(_every_position, 1, str(tmp_path), timeout=300)
    assert sorted(ref) == list(range(1, 6)) and len(out) == FILES_PER_SAVE + 2
    for k, leave_tmp, latest, resumed, had_tmp, tmp_after in out:
        # Until "latest" is rewritten (the last file), the previous checkpoint is the latest.
        assert latest == (4 if k == FILES_PER_SAVE and not leave_tmp else 2), (k, leave_tmp)
        assert sorted(resumed) == list(range(latest + 1, 6))
        for it, loss in resumed.items():
            assert loss == ref[it], (k, leave_tmp, it, loss, ref[it])  # exact: same layout
        assert had_tmp == leave_tmp
        assert tmp_after == [], tmp_after  # the later complete saves removed the debris
