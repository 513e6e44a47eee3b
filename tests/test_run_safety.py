"""No checkpoint lost by accident: a wrong --load or --save, two jobs on one directory, a run
that explodes, a failed save's leftovers, a damaged checkpoint given to generate_text.py.

Each probe runs ``pretrain_gpt.py`` as a user does and then checks that every checkpoint that
existed before is byte-identical and ``latest`` did not move.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from megazero.checkpoint import ownership
from megazero.checkpoint.files import SAVE_IN_PROGRESS
from megazero.checkpoint.save_check import remove_failed_saves
from megazero.config import ConfigError, load_config
from megazero.testing.launch import (
    REPO,
    SCRIPT,
    TINY,
    check,
    env,
    read_metrics,
    run_training,
)
from megazero.training.divergence import SpikeWatch
from megazero.training.resume_checks import check_save_path

TRACKER = "latest_checkpointed_iteration.txt"
BASE = [*TINY, "--lr-decay-iters", "100"]  # runs that resume with more --train-iters


def _snapshot(root) -> dict[str, str]:
    """Every file under ``root`` (the lock excepted) -> its SHA-256."""
    out = {}
    for base, _, names in os.walk(root):
        for n in names:
            if n == ownership.LOCK:
                continue
            path = os.path.join(base, n)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _one_error_line(proc, code=2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 8-iteration run saved every 2 iterations."""
    ck = tmp_path_factory.mktemp("run") / "ck"
    check(run_training([*BASE, "--train-iters", "8", "--save", str(ck), "--save-interval", "2"]))
    return ck


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_load_of_an_iteration_folder_is_refused_naming_the_root(run_dir, tmp_path):
    ck = _copy(run_dir, tmp_path / "ck")
    before = _snapshot(ck)
    proc = run_training([*BASE, "--train-iters", "12", "--save", str(ck),
                         "--load", str(ck / "iter_0000006")])
    line = _one_error_line(proc)
    assert f"--load {ck / 'iter_0000006'} is one iteration folder" in line, line
    assert f"pass --load {ck} (it resumes from iteration 8" in line, line
    assert f"write 6 into {ck / TRACKER}" in line, line
    assert _snapshot(ck) == before


def test_save_onto_a_run_without_load_is_refused_and_can_be_forced(run_dir, tmp_path):
    ck = _copy(run_dir, tmp_path / "ck")
    before = _snapshot(ck)
    line = _one_error_line(run_training([*BASE, "--train-iters", "4", "--save", str(ck),
                                         "--save-interval", "2", "--seed", "9"]))
    assert f"--save {ck} already holds checkpoints up to iteration 8 (latest: 8)" in line, line
    assert f"add --load {ck}" in line and "--overwrite-checkpoints" in line, line
    assert _snapshot(ck) == before
    # The explicit way to start over: the new run's iterations replace the old ones.
    check(run_training([*BASE, "--train-iters", "2", "--save", str(ck), "--seed", "9",
                        "--overwrite-checkpoints"]))
    assert (ck / TRACKER).read_text() == "2"
    assert _snapshot(ck)["iter_0000008/metadata.json"] == before["iter_0000008/metadata.json"]


def test_save_check_rules(tmp_path):
    """Unit level: what counts as newer, and the cases that stay allowed."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    for root, its in ((ck, (2, 4)), (other, (6,))):
        for it in its:
            d = root / f"iter_{it:07d}"
            d.mkdir(parents=True)
            (d / "metadata.json").write_text("{}")
        (root / TRACKER).write_text(str(its[-1]))
    (ck / "iter_0000009").mkdir()  # incomplete: not a checkpoint

    def cfg(*flags):
        return load_config([*BASE, "--train-iters", "10", *flags], 1)

    check_save_path(cfg("--save", str(ck), "--load", str(ck)))  # a resume
    check_save_path(cfg("--save", str(tmp_path / "new")))  # an empty directory
    check_save_path(cfg("--save", str(ck), "--overwrite-checkpoints"))
    # other's checkpoint (6) is newer than all of ck's: nothing of ck is overwritten
    check_save_path(cfg("--save", str(ck), "--load", str(other)))
    with pytest.raises(ConfigError, match="up to iteration 6"):
        check_save_path(cfg("--save", str(other), "--load", str(ck)))
    with pytest.raises(ConfigError, match="starts at iteration 0 .--load .* with --finetune"):
        check_save_path(cfg("--save", str(ck), "--load", str(other), "--finetune"))


def _lock_appears(ck, proc, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"job A ended early: {proc.communicate()}")
        try:
            return json.loads((ck / ownership.LOCK).read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError("job A never took the lock")


def _wait_for_save(ck, proc, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (ck / TRACKER).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError("job A never saved")
        time.sleep(0.05)


def test_two_jobs_on_one_directory_and_a_stale_lock(tmp_path):
    ck = tmp_path / "ck"
    args = [*BASE, "--save", str(ck), "--save-interval", "2", "--log-interval", "1000"]
    a = subprocess.Popen([sys.executable, SCRIPT, *args, "--train-iters", "100000"], cwd=REPO,
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = _lock_appears(ck, a)
        assert lock["pid"] == a.pid and lock["host"] == socket.gethostname()
        _wait_for_save(ck, a)
        # B: another seed, the same directory, resuming it (the check on newer checkpoints
        # passes): refused by the lock alone.
        b = run_training([*args, "--train-iters", "4", "--seed", "11", "--load", str(ck)])
        line = _one_error_line(b)
        assert f"--save {ck} is in use by run {lock['run_id']} (host {lock['host']}, pid " \
               f"{a.pid}" in line, line
        assert f"delete {ck / ownership.LOCK}" in line, line
    finally:
        a.send_signal(signal.SIGKILL)  # a crash: the lock stays behind
        a.communicate()
    assert json.loads((ck / ownership.LOCK).read_text())["run_id"] == lock["run_id"]
    latest = int((ck / TRACKER).read_text())
    meta = json.loads((ck / f"iter_{latest:07d}" / "metadata.json").read_text())
    assert meta["run_id"] == lock["run_id"]  # every checkpoint names the run that wrote it
    # C resumes A's run: the stale lock (its process is gone) is taken over with a warning.
    c = run_training([*args, "--load", str(ck), "--train-iters", str(latest + 2)])
    check(c)
    assert "took over the lock of run " + lock["run_id"] in c.stderr, c.stderr[-2000:]
    assert not (ck / ownership.LOCK).exists()  # released at the end
    meta = json.loads((ck / f"iter_{latest + 2:07d}" / "metadata.json").read_text())
    assert meta["run_id"] not in (None, lock["run_id"])


def test_lock_rules_without_processes(tmp_path, monkeypatch):
    me = ownership.RunOwner.this_process("me")
    assert ownership.claim(str(tmp_path), me) is None
    assert ownership.claim(str(tmp_path), me) is None  # its own lock again
    other = ownership.RunOwner.this_process("other")
    with pytest.raises(ownership.SaveDirBusy, match="in use by run me"):
        ownership.claim(str(tmp_path), other)
    assert ownership.verify(str(tmp_path), me) is None
    assert "now belongs to run me" in ownership.verify(str(tmp_path), other)
    # Another host: alive while its heartbeat is fresh, stale after STALE_AFTER_S.
    far = ownership.RunOwner("far", "elsewhere", 1, "1", "then")
    (tmp_path / ownership.LOCK).write_text(json.dumps(far.__dict__))
    with pytest.raises(ownership.SaveDirBusy, match="in use by run far"):
        ownership.claim(str(tmp_path), me)
    old = time.time() - ownership.STALE_AFTER_S - 5
    os.utime(tmp_path / ownership.LOCK, (old, old))
    assert "took over the lock of run far" in ownership.claim(str(tmp_path), me)
    ownership.release(str(tmp_path), other)  # not its lock: kept
    assert (tmp_path / ownership.LOCK).exists()
    ownership.release(str(tmp_path), me)
    assert not (tmp_path / ownership.LOCK).exists()


def test_a_save_refreshes_the_heartbeat(tmp_path):
    """verify(), called before every save, touches the lock: a long save interval on another
    host does not make the live job's lock look stale to a second job."""
    me = ownership.RunOwner.this_process("me")
    assert ownership.claim(str(tmp_path), me) is None
    lock = tmp_path / ownership.LOCK
    old = time.time() - ownership.STALE_AFTER_S - 60
    os.utime(lock, (old, old))
    assert ownership.verify(str(tmp_path), me) is None
    assert time.time() - os.path.getmtime(lock) < ownership.STALE_AFTER_S / 2
    # seen from another host, the job is alive again
    far_view = ownership.RunOwner("me", "elsewhere", 1, "1", "then")
    assert ownership.owner_alive(far_view, str(tmp_path))


def test_spike_rule():
    w = SpikeWatch(10.0, 5)
    assert not w.observe(1, 7.0, 3.0)
    assert w.judge(69.0, 3.0) is None and "loss 7.1000E+01" in w.judge(71.0, 3.0)
    for it in range(2, 12):
        assert not w.observe(it, 0.05, 0.2)  # a memorised set: loss near zero
    assert w.judge(9.0, 0.2) is None  # under 10 x max(1, median)
    assert "grad norm" in w.judge(0.05, 2.5)  # 10 sound norms seen: 12.5 x their median
    assert w.observe(12, 1e12, 5.0) and w.since == 12
    assert w.observe(13, 1e11, 5.0) and w.since == 12  # a spike does not raise the bar
    assert not w.observe(14, 0.06, 0.2) and w.since is None
    assert w.observe(15, float("nan"), float("nan")) and w.why == "the loss is NaN/inf"
    assert not SpikeWatch(0.0, 5).observe(1, 1e30, 1e30)  # --spike-factor 0: off


@pytest.mark.parametrize("saves", [[], ["--async-save"]], ids=["sync", "async"])
def test_exploded_run_saves_nothing_and_names_a_checkpoint_that_resumes(run_dir, tmp_path,
                                                                        saves):
    """An exploding run saves nothing from the spike on and names the newest sound checkpoint.
    With --async-save the save of iteration 9 is still in flight when the next step spikes: it is
    discarded once written, never committed, and the directory is as it was."""
    ck = _copy(run_dir, tmp_path / "ck")
    before = _snapshot(ck)
    # --lr 10: iterations 10-15 are finite spikes (loss 698 .. 5026), then NaN/inf on some
    # CPUs, while on others the loss stays finite (about 5e8): the run stops at the NaN/inf
    # count or at --max-spike-steps, alike
    bad = run_training([*BASE, "--save", str(ck), "--load", str(ck), "--lr", "10",
                        "--override-opt_param-scheduler", "--save-interval", "1",
                        "--train-iters", "30", *saves])
    line = _one_error_line(bad, code=3)
    assert "began to diverge at iteration 10 (loss " in line, line
    assert "not saving the checkpoint of iteration 12: the run is in a spike that began at " \
           "iteration 10" in bad.stdout, bad.stdout[-3000:]
    assert f"the newest checkpoint saved before it is iteration 8 in {ck}" in line, line
    assert "discarded the checkpoint of iteration 9" in bad.stdout, bad.stdout[-3000:]
    assert _snapshot(ck) == before  # iteration 9 came and went; 8 is latest again
    log = tmp_path / "resumed.jsonl"
    check(run_training([*BASE, "--load", str(ck), "--lr", "1e-3",
                        "--override-opt_param-scheduler", "--train-iters", "12",
                        "--log-json", str(log)]))
    m = read_metrics(log)
    assert sorted(m) == [9, 10, 11, 12] and all(math.isfinite(r["lm loss"]) for r in m.values())
    assert max(r["lm loss"] for r in m.values()) < 6.0, m


def test_failed_save_leftovers_are_removed_before_the_space_check(run_dir, tmp_path):
    ck = _copy(run_dir, tmp_path / "ck")
    partial = ck / "iter_0000010"  # an unfinished save: marked, above the tracker (8)
    (partial / "mp_rank_00_000_000").mkdir(parents=True)
    (partial / SAVE_IN_PROGRESS).write_text("\n")
    (partial / "mp_rank_00_000_000" / "model_000.pt").write_bytes(b"x" * 5000)
    (partial / "mp_rank_00_000_000" / "optim_000.pt.tmp.4242").write_bytes(b"x" * 3000)
    (ck / f"{TRACKER}.tmp.4242").write_text("10")
    shard_dir = next(p for p in (ck / "iter_0000008").iterdir() if p.is_dir())
    (shard_dir / "model_000.pt.tmp.4242").write_bytes(b"x" * 100)
    removed, freed = remove_failed_saves(str(ck))
    assert freed == 1 + 5000 + 3000 + 2 + 100 and len(removed) == 5, removed
    assert not partial.exists()
    assert (ck / "iter_0000008" / "metadata.json").exists()
    # Nothing megazero cannot prove is its own unfinished save is deleted: a folder with
    # other files, an unmarked one (a checkpoint whose metadata.json is lost), a marked one
    # at or below the tracker's iteration. Each is refused, naming it, and left as it was.
    for name, marked, extra in (("iter_0000012", True, "notes.txt"),
                                ("iter_0000012", False, None), ("iter_0000003", True, None)):
        folder = ck / name
        (folder / "mp_rank_00_000_000").mkdir(parents=True)
        (folder / "mp_rank_00_000_000" / "model_000.pt").write_bytes(b"x" * 10)
        if marked:
            (folder / SAVE_IN_PROGRESS).write_text("\n")
        if extra:
            (folder / extra).write_text("mine")
        with pytest.raises(ConfigError, match=f"{folder} has no metadata.json") as err:
            remove_failed_saves(str(ck))
        assert "Move the folder out" in str(err.value)
        assert (folder / "mp_rank_00_000_000" / "model_000.pt").exists()
        shutil.rmtree(folder)
    # In a run: the cleanup is logged with what it freed.
    (ck / f"{TRACKER}.tmp.4242").write_text("10")
    out = check(run_training([*BASE, "--save", str(ck), "--load", str(ck),
                              "--train-iters", "9"]))
    assert f"removed 1 files (2.0 B) left in {ck} by an earlier save" in out, out[-2000:]


def test_generate_text_errors_are_one_line(tmp_path):
    tool = os.path.join(REPO, "tools", "generate_text.py")
    for root in (tmp_path / "missing", tmp_path / "damaged"):
        if root.name == "damaged":
            (root / "iter_0000010").mkdir(parents=True)
            (root / TRACKER).write_text("10")
            (root / "iter_0000010" / "metadata.json").write_text("{")
        proc = subprocess.run([sys.executable, tool, "--load", str(root), "--prompt-ids", "1"],
                              env=env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
            "generate_text.py: error: "), proc.stderr
        assert str(root) in proc.stderr


def test_help_shows_the_defaults_of_the_two_flags():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], env=env(), capture_output=True,
                          text=True, timeout=120)
    text = " ".join(proc.stdout.split())
    assert "%(default)" not in text
    assert "stop after this many NaN/inf steps in a row; default: 3" in text
    assert "watchdog's limit for one iteration; default: 10.0" in text
