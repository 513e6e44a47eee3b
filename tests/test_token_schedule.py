"""Megatron-DeepSpeed's token-based schedule: ``--train-tokens`` stops the run once that many
tokens are consumed, ``--lr-warmup-tokens`` / ``--lr-decay-tokens`` count the warm-up and the
decay in tokens; the count is checkpointed and the banner says it. Checked against the formula
and across a save and resume."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from megazero.config import OptimizerConfig
from megazero.optim.lr_scheduler import LRScheduler, MegatronSchedule, build_lr_function
from megazero.testing.distributed import run_distributed
from megazero.testing.launch import read_metrics
from megazero.testing.training_runs import TINY

MAX, MIN = 1e-3, 1e-4


def _cosine(ratio: float) -> float:
    return MIN + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (MAX - MIN)


def test_token_warmup_and_decay_follow_megatron_deepspeed():
    f = build_lr_function(OptimizerConfig(lr=MAX, min_lr=MIN, lr_decay_style="cosine",
                                          lr_warmup_tokens=256, lr_decay_tokens=640), 100)
    assert isinstance(f, MegatronSchedule)
    # warm-up: max * tokens / warmup_tokens, whatever the step count
    assert [f(7, t) for t in (0, 128, 256)] == pytest.approx([0.0, MAX / 2, MAX])
    # decay: over the tokens from the warm-up's end to --lr-decay-tokens, then the minimum
    assert f(0, 384) == pytest.approx(_cosine(1 / 3))
    assert f(0, 640) == pytest.approx(MIN) and f(0, 10**9) == pytest.approx(MIN)
    # warm-up in steps, decay in tokens: the decay starts at the tokens the warm-up consumed
    g = build_lr_function(OptimizerConfig(lr=MAX, min_lr=MIN, lr_decay_style="linear",
                                          lr_warmup_iters=2, lr_decay_tokens=640), 100,
                          tokens_at=lambda k: 128 * k)
    assert g(1, 128) == pytest.approx(MAX / 2) and g(2, 256) == pytest.approx(MAX)
    assert g(3, 448) == pytest.approx(MAX - (448 - 256) / (640 - 256) * (MAX - MIN))
    # warm-up in tokens, decay in steps
    h = build_lr_function(OptimizerConfig(lr=MAX, min_lr=MIN, lr_decay_style="linear",
                                          lr_warmup_tokens=256, lr_decay_iters=10), 10)
    assert h(1, 128) == pytest.approx(MAX / 2) and h(5, 512) == pytest.approx(MAX - 0.5 * (
        MAX - MIN))


def test_scheduler_keeps_its_tokens_in_its_state():
    groups = [{"lr": None}]
    f = build_lr_function(OptimizerConfig(lr=MAX, min_lr=MIN, lr_warmup_tokens=256,
                                          lr_decay_tokens=640, lr_decay_style="cosine"), 10)
    s = LRScheduler(groups, f)
    s.step(tokens=384)
    state = s.state_dict()
    assert state == {"num_steps": 1, "num_tokens": 384}
    groups2 = [{"lr": None}]
    s2 = LRScheduler(groups2, f)
    s2.load_state_dict(state)
    assert groups2[0]["lr"] == pytest.approx(_cosine(1 / 3)) == groups[0]["lr"]


ARGS = [a for i, a in enumerate(TINY) if a not in ("--lr-warmup-iters", "--lr-decay-iters")
        and TINY[i - 1] not in ("--lr-warmup-iters", "--lr-decay-iters")]
# 8 samples x 16 tokens = 128 tokens per iteration: 640 tokens are 5 iterations, before the 10
# of --train-samples (Megatron-DeepSpeed's scripts give both, the samples as an upper bound)
TOKENS = [*ARGS, "--lr", str(MAX), "--min-lr", str(MIN), "--train-tokens", "640",
          "--train-samples", "80",
          "--lr-warmup-tokens", "256", "--lr-decay-tokens", "640", "--log-interval", "1"]


def _train(rank, world, args):
    from megazero.testing.training_runs import train_in_rank

    _, run = train_in_rank(rank, world, args, keep_run=True)
    return run.state.iteration, run.state.exit_reason, run.scheduler.state_dict()


def _train_printing(rank, world, args):
    """``_train`` and what the rank printed (captured in the rank: a rank's stdout is the
    forkserver's, not the test's)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = _train(rank, world, args)
    return (*result, buf.getvalue())


def test_a_run_stops_at_train_tokens_and_resumes_its_schedule(tmp_path):
    log, ck = tmp_path / "full.jsonl", str(tmp_path / "ck")
    (iters, _, state, out), = run_distributed(_train_printing, 1,
                                               [*TOKENS, "--log-json", str(log)])
    assert iters == 5 and state == {"num_steps": 5, "num_tokens": 640}
    assert "10 iterations or 640 tokens (--train-tokens), whichever comes first" in out
    assert "> learning rate: cosine from 0.001 to 0.0001, warm-up 256 tokens, decay over 640 " \
           "tokens" in out
    assert "reached --train-tokens 640 at iteration 5 (640 tokens)" in out
    full = read_metrics(log)
    # the rate logged with iteration i is the next step's: that of the 128 i tokens consumed
    expected = [MAX / 2, MAX, _cosine(1 / 3), _cosine(2 / 3), MIN]
    assert [full[i]["learning-rate"] for i in range(1, 6)] == pytest.approx(expected)
    # a run that stops at iteration 2 and resumes continues the same schedule and losses
    log2 = tmp_path / "resumed.jsonl"
    run_distributed(_train, 1, [*TOKENS, "--save", ck, "--exit-interval", "2"])
    (iters, _, state), = run_distributed(_train, 1, [*TOKENS, "--load", ck, "--save", ck,
                                                     "--log-json", str(log2)])
    resumed = read_metrics(log2)
    assert iters == 5 and sorted(resumed) == [3, 4, 5]
    for i in (3, 4, 5):
        assert resumed[i]["learning-rate"] == pytest.approx(full[i]["learning-rate"])
        assert resumed[i]["lm loss"] == pytest.approx(full[i]["lm loss"], rel=1e-6)
    # relaunched once more, the finished run says it is complete and trains nothing
    (iters, why, _, out), = run_distributed(_train_printing, 1,
                                            [*TOKENS, "--load", ck, "--save", ck])
    assert (iters, why) == (5, "already complete")
    assert "which already reached --train-tokens 640 (640 tokens consumed); the run is " \
           "complete" in out
