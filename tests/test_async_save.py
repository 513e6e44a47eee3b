"""``--async-save``: the same files as a synchronous save, written while training goes on.

In one spawned world of 2 gloo ranks, each layout trains twice from the same seed, saving every
2 iterations: synchronously, then with ``--async-save``. Every file of every checkpoint must hold
the same tensors (and the index the same entries), at ZeRO 0-3, with the optimizer offloaded to
the CPU, with parameters on NVMe, with MoE (expert parallel 2) and with context parallel 2, and
the losses must not change. A writer that fails on one rank is one line from rank 0 naming the
rank, the path and the cause; the tracker stays, and training goes on, or stops on every rank
with ``--exit-on-save-failure``.
"""

from __future__ import annotations

import errno
import glob
import io
import json
import os
from contextlib import redirect_stdout

import pytest
import torch

from megazero.testing.distributed import run_distributed
from megazero.testing.faults import FailingWriter
from megazero.testing.training_runs import TINY, train_in_rank

ITERS = ["--train-iters", "4", "--save-interval", "2"]


def _ds(tmp: str, name: str, zero: dict) -> list[str]:
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "zero_optimization": zero}, f)
    return ["--deepspeed_config", path]


def _layouts(tmp: str) -> dict[str, list[str]]:
    swap = os.path.join(tmp, "swap")
    os.makedirs(swap, exist_ok=True)
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    return {
        "zero 0": ["--zero-stage", "0"],
        "zero 1": ["--zero-stage", "1"],
        "zero 2": ["--zero-stage", "2"],
        "zero 3": _ds(tmp, "z3", z3),
        "zero 2, cpu offload": _ds(tmp, "z2cpu", {"stage": 2,
                                                 "offload_optimizer": {"device": "cpu"}}),
        "zero 3, nvme": _ds(tmp, "z3nvme", dict(z3, offload_param={
            "device": "nvme", "nvme_path": swap, "buffer_size": 100000, "max_in_cpu": 0})),
        "moe ep 2": ["--zero-stage", "1", "--num-experts", "4", "--moe-router-topk", "2",
                     "--expert-model-parallel-size", "2"],
        "cp 2": ["--zero-stage", "1", "--context-parallel-size", "2"],
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _index(path: str) -> dict:
    meta = json.load(open(path))
    for key in ("run_id", "sha256"):
        meta.pop(key)
    meta["files"].pop("config.json")  # its text names the --save directory
    return meta


def _compare(sync: str, asyn: str) -> list[str]:
    """What differs between two checkpoint directories (empty: nothing)."""
    problems = []
    if open(f"{sync}/latest_checkpointed_iteration.txt").read() != open(
            f"{asyn}/latest_checkpointed_iteration.txt").read():
        problems.append("tracker")
    for it in (2, 4):
        a, b = f"{sync}/iter_{it:07d}", f"{asyn}/iter_{it:07d}"
        names = sorted(os.path.relpath(p, a) for p in glob.glob(f"{a}/**/*", recursive=True))
        if names != sorted(os.path.relpath(p, b) for p in glob.glob(f"{b}/**/*",
                                                                      recursive=True)):
            problems.append(f"files of iteration {it}")
            continue
        for rel in names:
            if rel.endswith(".pt") and not _same(
                    torch.load(f"{a}/{rel}", weights_only=True),
                    torch.load(f"{b}/{rel}", weights_only=True)):
                problems.append(f"{rel} of iteration {it}")
        if _index(f"{a}/metadata.json") != _index(f"{b}/metadata.json"):
            problems.append(f"metadata.json of iteration {it}")
    return problems


def _layouts_rank(rank, world, tmp):
    out = {}
    for name, layout in _layouts(tmp).items():
        d = os.path.join(tmp, name.replace(" ", "_").replace(",", ""))
        sync = train_in_rank(rank, world, [*TINY, *ITERS, *layout, "--save", f"{d}/sync"])
        buf = io.StringIO()
        with redirect_stdout(buf):
            asyn = train_in_rank(rank, world, [*TINY, *ITERS, *layout, "--save", f"{d}/async",
                                               "--async-save"])
        problems = _compare(f"{d}/sync", f"{d}/async") if rank == 0 else []
        out[name] = (sync == asyn, problems, buf.getvalue())
    return out


def test_async_checkpoints_equal_the_synchronous_ones(tmp_path):
    results = run_distributed(_layouts_rank, 2, str(tmp_path), timeout=900)
    for name, (same_losses, problems, log) in results[0].items():
        assert same_losses and results[1][name][0], name
        assert problems == [], (name, problems)
        for it in (2, 4):
            assert f"saved checkpoint at iteration {it:7d}" in log and "asynchronously" in log, (
                name, log)


class FailsOnce(FailingWriter):
    """A full disk for the first file this writer commits, then room again."""

    def __init__(self) -> None:
        super().__init__(1, errno.ENOSPC)
        self.failed = False

    def commit(self, tmp: str, path: str) -> None:
        if self.failed:
            return super(FailingWriter, self).commit(tmp, path)
        self.failed = True
        super().commit(tmp, path)


def _failing_rank(rank, world, tmp, stop):
    args = [*TINY, "--train-iters", "6", "--save-interval", "2", "--save", f"{tmp}/ck",
            "--async-save", *(["--exit-on-save-failure"] if stop else [])]
    writer = FailsOnce() if rank == 1 else None  # rank 1's first file, of the first save
    buf = io.StringIO()
    error = None
    with redirect_stdout(buf):
        try:
            losses = train_in_rank(rank, world, args, writer=writer)
        except Exception as e:  # noqa: BLE001 - returned to the test
            error, losses = e, None
    return buf.getvalue(), losses, (type(error).__name__, str(error)) if error else None


@pytest.mark.parametrize("stop", [False, True])
def test_a_failed_async_write_is_one_line_and_the_tracker_stays(tmp_path, stop):
    results = run_distributed(_failing_rank, 2, str(tmp_path), stop, timeout=300)
    log = results[0][0]
    lines = [x for x in log.splitlines() if "asynchronous save of iteration 2 failed" in x]
    assert len(lines) == 1 and "on rank 1:" in lines[0] and "No space left on device" in lines[0] \
        and str(tmp_path / "ck" / "iter_0000002") in lines[0], log
    assert not (tmp_path / "ck" / "iter_0000002").exists()  # removed; it was never latest
    if stop:
        for _, losses, error in results:  # every rank stops alike, with one message
            assert losses is None and error[0] == "CheckpointError", error
            assert "--exit-on-save-failure" in error[1]
        assert not (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()
        return
    for _, losses, error in results:
        assert error is None and sorted(losses) == list(range(1, 7))
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert "saved checkpoint at iteration       4" in log, log


def _staging_rank(rank, world, tmp):
    from megazero.checkpoint.save_check import checkpoint_bytes
    from megazero.planner.estimate import ASYNC_STAGING_ITEM, rank_memory

    out = {}
    for name in ("zero 1", "zero 3"):
        layout = _layouts(tmp)[name]
        _, run = train_in_rank(rank, world, [*TINY, "--train-iters", "1", *layout,
                                             "--async-save"], keep_run=True)
        plan = rank_memory(run.cfg, 0, run.batching.num_microbatches, device_is_cpu=True)
        out[name] = (checkpoint_bytes(run.engine), plan.host[ASYNC_STAGING_ITEM])
    return out


def test_the_planner_counts_the_staging_the_run_checks(tmp_path):
    """--async-save's host copy: the estimator's line is the bytes the run's own start-up check
    compares with the host's available memory (the engine's parameter and optimizer bytes)."""
    from megazero.checkpoint.save_check import staging_problem

    for rank_bytes, planned in run_distributed(_staging_rank, 2, str(tmp_path),
                                               timeout=300)[0].values():
        assert rank_bytes > 0 and abs(planned - rank_bytes) <= 0.02 * rank_bytes, (
            rank_bytes, planned)
    assert staging_problem(10 * 2**30, 4, 64 * 2**30) is None
    problem = staging_problem(10 * 2**30, 8, 64 * 2**30)
    assert problem is not None and problem.startswith("--async-save: each rank copies") and \
        "10.0 GB on this rank, 80.0 GB for the 8 ranks of this host" in problem
