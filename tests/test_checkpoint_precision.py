"""fp16: the dynamic loss scale survives a reshard (tp2 ZeRO-1 -> dp2 ZeRO-2, with and without
the optimizer offloaded); a checkpoint trained without fp16 resumed
with --fp16 starts the scaler from the configuration and says so."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY, train_in_rank

MODEL = [*TINY, "--num-layers", "2", "--global-batch-size", "4"]


def _scale_after(rank, world, args):
    losses, run = train_in_rank(rank, world, args, keep_run=True)
    return losses, run.engine.loss_scale, run.state.history


def _runs(rank, world, tmp):
    ds, ds_off = os.path.join(tmp, "fp16.json"), os.path.join(tmp, "fp16_offload.json")
    fp16_block = {"enabled": True, "initial_scale_power": 30, "hysteresis": 1}
    if rank == 0:  # 2**30 overflows at first: the scale moves while training
        with open(ds, "w") as f:
            json.dump({"train_batch_size": "auto", "fp16": fp16_block}, f)
        with open(ds_off, "w") as f:
            json.dump({"train_batch_size": "auto", "fp16": fp16_block, "zero_optimization": {
                "stage": 2, "offload_optimizer": {"device": "cpu"}}}, f)
    import torch.distributed as dist
    dist.barrier()
    fp16 = [*MODEL, "--fp16", "--deepspeed_config", ds]
    tp2 = ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]
    dp2 = ["--zero-stage", "2"]
    saved = _scale_after(rank, world, [*fp16, *tp2, "--train-iters", "4", "--save",
                                       f"{tmp}/h"])
    cont = _scale_after(rank, world, [*fp16, *tp2, "--train-iters", "6", "--load",
                                      f"{tmp}/h"])
    reshard = _scale_after(rank, world, [*fp16, *dp2, "--train-iters", "6", "--load",
                                         f"{tmp}/h"])
    offload = _scale_after(rank, world, [*MODEL, "--fp16", "--deepspeed_config", ds_off,
                                         "--train-iters", "6", "--load", f"{tmp}/h"])
    _scale_after(rank, world, [*MODEL, *dp2, "--train-iters", "2", "--save", f"{tmp}/f32"])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        switched = _scale_after(rank, world, [*fp16, *dp2, "--train-iters", "2", "--load",
                                              f"{tmp}/f32"])
    return saved, cont, reshard, switched, log.getvalue(), offload


def test_loss_scale_reshards_and_precision_switch(tmp_path):
    out = run_distributed(_runs, 2, str(tmp_path), timeout=300)
    saved, cont, reshard, switched, log, offload = out[0]
    assert saved[1] < 2.0 ** 30  # the scale is live (it moved down after overflows)
    assert sorted(cont[0]) == sorted(reshard[0]) == [5, 6]
    for it in (5, 6):
        assert reshard[0][it] == pytest.approx(cont[0][it], rel=1e-3)  # fp16 rounding
    assert [h["loss_scale"] for h in reshard[2]] == [h["loss_scale"] for h in cont[2]]
    assert reshard[1] == cont[1]
    assert offload[0] == reshard[0]  # optimizer offloaded to the host: the same numbers
    assert switched[1] == 2.0 ** 30  # from the config, not the fp32 checkpoint
    assert "the loss scaler starts from the configured initial scale" in log
