"""Resharding matrix: train 2 iterations at layout A and save; load at B and train 2 more; the
losses after loading at B equal those after loading at A (the same layout).

Cases, all in one 8-rank world (plus one process for the last):

1. tp2 x pp2 x dp2, ZeRO-1  ->  tp1 x pp4 x dp2, ZeRO-3 (every parameter partitioned)
2. tp4 x dp2, ZeRO-0        ->  tp2 x dp4, ZeRO-2 with the optimizer offloaded to the host
3. tp2 x pp2 x vpp2 x dp2   ->  tp2 x pp4 (vpp 1, dp 1)
4. case 1's 8-rank checkpoint  ->  one process

fp16 with a live loss scale across a reshard is covered by test_checkpoint_precision.py.

Tolerance: fp32, dropout 0; the layouts only sum in different orders (TP partial sums,
pipeline micro-batch accumulation, the dp reduction). After two Adam steps the losses agree to
~1e-7 relative; we allow 1e-5. A wrong slice, a lost optimizer moment or a stale master moves
the loss by 1e-3 and more (Adam's first steps after loading depend on m and v).
"""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY, train_in_rank

LOSS_RTOL = 1e-5
MODEL = [*TINY, "--global-batch-size", "8", "--micro-batch-size", "2"]


def _par(tp=1, pp=1, vpp=None, zero=None, ds=None):
    out = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if vpp is not None:
        out += ["--num-layers-per-virtual-pipeline-stage", str(4 // (pp * vpp))]
    if zero is not None:
        out += ["--zero-stage", str(zero)]
    if ds is not None:
        out += ["--deepspeed_config", ds]
    return out


def _configs(tmp):
    z3 = os.path.join(tmp, "z3.json")
    z2off = os.path.join(tmp, "z2off.json")
    with open(z3, "w") as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                         "stage3_max_reuse_distance": 0}}, f)
    with open(z2off, "w") as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                  f)
    return z3, z2off


def _cases(tmp):
    z3, z2off = _configs(tmp)
    return {"tp2pp2dp2 z1 -> tp1pp4dp2 z3": (_par(2, 2, zero=1), _par(1, 4, ds=z3)),
            "tp4dp2 -> tp2dp4 z2 offload": (_par(4), _par(2, ds=z2off)),
            "tp2pp2vpp2dp2 -> tp2pp4": (_par(2, 2, vpp=2, zero=1), _par(2, 4))}


def _world(rank, world, tmp):
    import torch.distributed as dist

    if rank == 0:
        _configs(tmp)
    dist.barrier()
    out = {}
    for i, (name, (a, b)) in enumerate(_cases(tmp).items()):
        ck = f"{tmp}/c{i}"
        train_in_rank(rank, world, [*MODEL, *a, "--train-iters", "2", "--save", ck])
        at_a = train_in_rank(rank, world, [*MODEL, *a, "--train-iters", "4", "--load", ck])
        at_b = train_in_rank(rank, world, [*MODEL, *b, "--train-iters", "4", "--load", ck])
        out[name] = (at_a, at_b)
    return out


def _one_process(rank, world, tmp):
    return train_in_rank(rank, world, [*MODEL, "--train-iters", "4", "--load", f"{tmp}/c0"])


def test_reshard_matrix_losses_match_the_saved_layout(tmp_path):
    tmp = str(tmp_path)
    out = run_distributed(_world, 8, tmp, timeout=400)[0]
    assert sorted(out) == sorted(_cases(tmp))
    for name, (at_a, at_b) in out.items():
        assert sorted(at_a) == sorted(at_b) == [3, 4], name
        for it in (3, 4):
            assert at_b[it] == pytest.approx(at_a[it], rel=LOSS_RTOL), (name, it)
    [single] = run_distributed(_one_process, 1, tmp, timeout=200)
    at_a = out["tp2pp2dp2 z1 -> tp1pp4dp2 z3"][0]
    assert sorted(single) == [3, 4]
    for it in (3, 4):
        assert single[it] == pytest.approx(at_a[it], rel=LOSS_RTOL), ("one process", it)
