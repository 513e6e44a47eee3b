"""Loading at another layout is pure data movement, and training goes on as at the saved one.

Model: vocab 101 (not a multiple of 128 * tp: padding rows are stripped and re-added), GQA
(4 heads, 2 query groups), tied embeddings split over pp 2 (the last stage's copy is loaded
from the embedding's name), hidden 40 (norm and bias sizes not divisible by dp 3).
Layouts: A = tp2 x pp2 x vpp2, ZeRO-1 (4 ranks); B = dp3, ZeRO-3 with
stage3_param_persistence_threshold 0 (every parameter partitioned; 3 ranks); C = one process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.checkpoint import read_global_tensors, read_model_state
from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY, train_in_rank

MODEL = [*TINY, "--vocab-size", "101", "--hidden-size", "40", "--num-query-groups", "2",
         "--group-query-attention", "--global-batch-size", "12"]
A = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--num-layers-per-virtual-pipeline-stage", "1", "--zero-stage", "1"]
KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")
# fp32: the layouts sum in different orders; two Adam steps after the load keep the losses
# within this relative distance (observed ~1e-7).
LOSS_RTOL = 1e-5


def _layout_a(rank, world, tmp):
    first = train_in_rank(rank, world, [*MODEL, *A, "--train-iters", "2",
                                        "--save", f"{tmp}/a"])
    resumed = train_in_rank(rank, world, [*MODEL, *A, "--train-iters", "4", "--load",
                                          f"{tmp}/a", "--save", f"{tmp}/a_resumed"])
    return first, resumed


def _layout_b(rank, world, tmp, ds):
    from megazero.training.save_policy import save as _save

    b = [*MODEL, "--deepspeed_config", ds]
    _, run = train_in_rank(rank, world, [*b, "--train-iters", "2", "--load", f"{tmp}/a",
                                         "--save", f"{tmp}/b"], keep_run=True)
    _save(run)  # loaded at iteration 2, saved again at this layout without a step
    losses, run = train_in_rank(rank, world, [*b, "--train-iters", "4", "--load", f"{tmp}/a",
                                              "--save", f"{tmp}/b_trained"], keep_run=True)
    full = run.engine.full_parameters()  # the trained ZeRO-3 weights, gathered
    names = {id(p): n for n, p in run.chunks[0].named_parameters()}
    return losses, {names[k]: v.numpy() for k, v in full.items()}  # numpy: picklable


def _layout_c(rank, world, tmp, flag):
    from megazero.config import load_config
    from megazero.training.lifecycle import setup

    run = setup(load_config([*MODEL, "--train-iters", "4", "--load", f"{tmp}/b_trained",
                             flag], 1))  # setup loads the checkpoint; no step taken
    run.monitor.close()
    return {n: p.detach().numpy().copy() for n, p in run.chunks[0].named_parameters()}


def test_reshard_is_data_movement_and_training_continues(tmp_path):
    tmp = str(tmp_path)
    ds = os.path.join(tmp, "ds3.json")
    with open(ds, "w") as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "zero_optimization": {"stage": 3,
                                         "stage3_param_persistence_threshold": 0}}, f)
    (first, resumed_a), *_ = run_distributed(_layout_a, 4, tmp, timeout=300)
    (losses_b, trained_b), *_ = run_distributed(_layout_b, 3, tmp, ds, timeout=300)
    # the model holds the padded vocabulary (128 rows), checkpoints the 101 real ones
    trained_b = {k: torch.from_numpy(v)[:101] if k.startswith("embedding.word") else
                 torch.from_numpy(v) for k, v in trained_b.items()}

    # Pure data movement: A's checkpoint == B's re-save of it, bit for bit, every kind.
    a = read_global_tensors(f"{tmp}/a", kinds=KINDS)
    b = read_global_tensors(f"{tmp}/b", kinds=KINDS)
    assert a["weight"]["embedding.word_embeddings.weight"].shape == (101, 40)
    for kind in KINDS:
        assert sorted(a[kind]) == sorted(b[kind])
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
    assert float(a["exp_avg_sq"]["decoder.layers.3.mlp.linear_fc2.weight"].abs().sum()) > 0

    # Training after the reshard matches resuming at A.
    assert sorted(resumed_a) == sorted(losses_b) == [3, 4]
    for it in (3, 4):
        assert losses_b[it] == pytest.approx(resumed_a[it], rel=LOSS_RTOL)

    # ZeRO-3 checkpoints hold the real (trained) weights.
    _, saved = read_model_state(f"{tmp}/b_trained")
    assert sorted(saved) == sorted(trained_b)
    for name, t in trained_b.items():
        assert t.numel() > 0 and torch.equal(saved[name], t), name

    # --finetune / --no-load-optim from the ZeRO-3 checkpoint, one process: weights arrive.
    for flag in ("--finetune", "--no-load-optim"):
        [loaded] = run_distributed(_layout_c, 1, tmp, flag, timeout=120)
        for name, t in trained_b.items():
            got = torch.from_numpy(loaded[name])
            got = got[:101] if name == "embedding.word_embeddings.weight" else got
            assert torch.equal(got, t), (flag, name)
