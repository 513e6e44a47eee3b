"""Megatron's ``--decoupled-lr`` / ``--decoupled-min-lr``: the input embedding and output layer
follow the schedule between their own peak and minimum, every other parameter the main one, at
any layout (TP, PP, ZeRO)."""

from __future__ import annotations

import pytest
import torch

from megazero.config import OptimizerConfig
from megazero.optim.lr_scheduler import LRScheduler, build_lr_function, decoupled_schedule
from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY


def test_decoupled_groups_follow_their_own_peak_and_minimum():
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=5e-4,
                          lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="linear")
    main = build_lr_function(cfg, 10)
    groups = [{"lr": None}, {"lr": None, "decoupled": True}]
    s = LRScheduler(groups, main, decoupled=decoupled_schedule(cfg, main))
    seen = []
    for _ in range(12):
        s.step()
        seen.append((groups[0]["lr"], groups[1]["lr"]))
    assert seen[0] == pytest.approx((5e-4, 2.5e-3))  # warm-up, half way
    assert seen[5] == pytest.approx((1e-3 - 0.5 * 9e-4, 5e-3 - 0.5 * 4.5e-3))  # decay, half way
    assert seen[-1] == pytest.approx((1e-4, 5e-4))
    no_min = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3)
    assert decoupled_schedule(no_min, build_lr_function(no_min, 10)).min_lr == 1e-4


def _step_once(rank, world, args):
    from megazero.convert import model_global_state
    from megazero.testing.training_runs import train_in_rank

    _, run = train_in_rank(rank, world, args, keep_run=True)
    with run.engine.gathered_parameters():
        parts = [model_global_state(c, run.topo) for c in run.chunks]
    # numpy arrays: tensors would cross the queue as shared memory the rank frees on exit
    state = {k: v.float().numpy().copy() for part in parts for k, v in part.items()}
    lrs = sorted((g.get("name"), g["lr"]) for g in run.engine.param_groups)
    return state, lrs


ARGS = [*TINY, "--train-iters", "1", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
        "--untie-embeddings-and-output-weights", "--weight-decay", "0"]
EMB = ("embedding.word_embeddings.weight", "output_layer.weight")


@pytest.fixture(scope="module")
def init():
    return run_distributed(_step_once, 1, [*ARGS, "--lr", "0"])[0]  # nothing moves


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2",
                                         "--pipeline-model-parallel-size", "2",
                                         "--zero-stage", "2"]])
def test_only_the_embedding_and_output_layer_move_at_lr_zero(layout, init):
    """--lr 0 with --decoupled-lr X: after one step the embedding and output layer hold what a
    run at --lr X gives them, every other weight its initial value."""
    world = 4 if layout else 1
    decoupled = run_distributed(_step_once, world, [*ARGS, *layout, "--lr", "0",
                                                    "--decoupled-lr", "1e-2"])
    plain = run_distributed(_step_once, world, [*ARGS, *layout, "--lr", "1e-2"])
    state = {k: v for rank_state, _ in decoupled for k, v in rank_state.items()}  # all stages
    reference = {k: v for rank_state, _ in plain for k, v in rank_state.items()}
    lrs = decoupled[0][1]
    assert lrs == [("decay", 0.0), ("decoupled", pytest.approx(1e-2)), ("no_decay", 0.0)]
    assert set(EMB) <= set(state)
    for name, value in state.items():
        value, start = torch.from_numpy(value), torch.from_numpy(init[0][name])
        if name in EMB:
            torch.testing.assert_close(value, torch.from_numpy(reference[name]), rtol=1e-6,
                                       atol=1e-7)
            assert not torch.equal(value, start), name
        else:
            assert torch.equal(value, start), name
