"""Checkpoint I/O: layout on disk, exact restore, crash safety, layout errors (dummy state)."""

import json
import os
import random

import numpy as np
import pytest
import torch

from megazero.checkpoint import TRACKER, load_checkpoint, read_tracker, save_checkpoint
from megazero.distributed.topology import ParallelTopology
from megazero.errors import CheckpointError
from megazero.testing.checkpoint_state import build_state, train_steps
from megazero.testing.distributed import DistributedTestError, run_distributed
from megazero.testing.faults import CrashingWriter


def _save_run(rank, world, root, fault_rank=None):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = build_state(topo)
    train_steps(models, opt, sched, 3)
    save_checkpoint(root, 10, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=80, config={"tp": 2}, rng_tracker=tracker)
    expect = {"weights": [p.detach().numpy().copy() for m in models for p in m.parameters()],
              "next": torch.randn(3).numpy(), "np": np.random.rand(), "py": random.random(),
              "tracker": torch.randn(2, generator=tracker.gen).numpy(),
              "lr": opt.param_groups[0]["lr"]}
    train_steps(models, opt, sched, 2)
    # fault_rank dies (os._exit) after writing one file of iteration 20
    writer = CrashingWriter(1, hard=True) if fault_rank == rank else None
    save_checkpoint(root, 20, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=160, config={"tp": 2}, rng_tracker=tracker, writer=writer)
    return expect


def _load_run(rank, world, root):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = build_state(topo, seed=99)  # different init: load must overwrite
    res = load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                          rng_tracker=tracker)
    got = {"weights": [p.detach().numpy().copy() for m in models for p in m.parameters()],
           "next": torch.randn(3).numpy(), "np": np.random.rand(), "py": random.random(),
           "tracker": torch.randn(2, generator=tracker.gen).numpy(),
           "lr": opt.param_groups[0]["lr"],
           "momentum": [float(opt.state[p]["momentum_buffer"].abs().sum())
                        for p in opt.param_groups[0]["params"]]}
    return res, got


def test_save_layout_and_exact_restore(tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(_save_run, 4, root, timeout=60)
    names = sorted(os.listdir(os.path.join(root, "iter_0000010")))
    assert names == ["config.json", "metadata.json", "mp_rank_00_000_000", "mp_rank_00_000_001",
                     "mp_rank_01_000_000", "mp_rank_01_000_001"]
    # without the ZeRO engine dp rank 0 writes the weights; every rank its RNG states
    assert sorted(os.listdir(os.path.join(root, "iter_0000010", "mp_rank_01_000_000"))) == [
        "model_000.pt", "optim_rng.pt"]
    assert os.listdir(os.path.join(root, "iter_0000010", "mp_rank_01_000_001")) == [
        "optim_rng.pt"]
    assert read_tracker(root) == 20
    meta = json.loads(open(os.path.join(root, "iter_0000020", "metadata.json")).read())
    assert meta["layout"] == {"tp": 2, "pp": 1, "dp": 2, "vpp": 1, "zero_stage": 0}
    assert not [f for _, _, fs in os.walk(root) for f in fs if ".tmp." in f]
    # Load iteration 10 explicitly, compare with what the saving run had at iteration 10.
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("10")
    saved = run_distributed(_save_run_expectations, 4, str(tmp_path / "again"), timeout=60)
    loaded = run_distributed(_load_run, 4, root, timeout=60)
    for exp, (res, got) in zip(saved, loaded):
        assert (res.iteration, res.consumed_samples) == (10, 80)
        assert len(exp["weights"]) == len(got["weights"]) == 4
        for a, b in zip(exp["weights"], got["weights"]):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(exp["next"], got["next"])
        np.testing.assert_array_equal(exp["tracker"], got["tracker"])
        assert exp["np"] == got["np"] and exp["py"] == got["py"]
        assert exp["lr"] == got["lr"] == pytest.approx(0.1 / 4)
        assert all(m > 0 for m in got["momentum"])


def _save_run_expectations(rank, world, root):
    return _save_run(rank, world, root)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    # Rank 1 dies after one file of iteration 20; the others fail at the barrier.
    with pytest.raises(DistributedTestError):
        run_distributed(_save_run, 4, root, fault_rank=1, timeout=60)
    assert read_tracker(root) == 10
    assert os.path.isdir(os.path.join(root, "iter_0000020"))  # partly written
    assert not os.path.exists(os.path.join(root, "iter_0000020", "metadata.json"))
    loaded = run_distributed(_load_run, 4, root, timeout=60)
    assert all(res.iteration == 10 and res.consumed_samples == 80 for res, _ in loaded)
    with pytest.raises(DistributedTestError, match="did not complete"):
        run_distributed(_load_explicit, 4, root, 20, timeout=60)


def _load_explicit(rank, world, root, iteration):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = build_state(topo)
    return load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                           iteration=iteration)


def test_layout_mismatch_and_finetune(tmp_path):
    root = str(tmp_path / "ckpt")
    topo = ParallelTopology.single()
    models, opt, sched, tracker = build_state(topo)
    assert load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched) is None
    train_steps(models, opt, sched, 2)
    save_checkpoint(root, 5, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=40, config={}, zero_stage=1)
    with pytest.raises(CheckpointError, match=r"saved at layout tp=1 pp=1 dp=1 vpp=1 "
                       r"zero_stage=1, but this run is tp=1 pp=1 dp=1 vpp=1 zero_stage=2"):
        load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched, zero_stage=2)
    m2, o2, s2, _ = build_state(topo, seed=5)
    res = load_checkpoint(root, topo, models=m2, optimizer=o2, scheduler=s2, zero_stage=2,
                          finetune=True)
    assert (res.iteration, res.consumed_samples) == (0, 0)
    assert torch.equal(m2[0].weight, models[0].weight) and not o2.state and s2.num_steps == 0
    m3, o3, s3, _ = build_state(topo, seed=6)
    res = load_checkpoint(root, topo, models=m3, optimizer=o3, scheduler=s3, zero_stage=1,
                          no_load_optim=True, no_load_rng=True)
    assert res.iteration == 5 and not o3.state and torch.equal(m3[1].bias, models[1].bias)
