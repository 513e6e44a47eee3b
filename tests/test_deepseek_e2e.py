"""``pretrain_gpt.py`` with the DeepSeek-V3 shape (multi-latent attention, one
multi-token-prediction depth, group-limited sigmoid routing with the expert bias, a dense first
layer, a shared expert) trains the same model at every layout: TP 2 + SP x EP 2 x ZeRO 1, and
PP 2 x CP 2 x ZeRO 3 resumed from the first layout's checkpoint at iteration 2, give the
one-process run's ``lm loss``, ``mtp_1 loss`` and grad norms to fp32 rounding. The MTP depth
counts: without it (scaling factor 0) the grad norms differ."""

from __future__ import annotations

import pytest

from megazero.testing.deepseek_runs import DEEPSEEK
from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training

KEYS = ("lm loss", "mtp_1 loss", "grad-norm")


def _compare(a: dict, b: dict, its, tag: str) -> None:
    for it in its:
        for key in KEYS:
            rel = LOSS_RTOL if "loss" in key else 1e-5
            assert b[it][key] == pytest.approx(a[it][key], rel=rel), (tag, it, key)


def test_deepseek_shape_trains_the_one_process_model(tmp_path):
    ref, got_a, got_b = (tmp_path / f"{n}.jsonl" for n in ("ref", "a", "b"))
    out = check(run_training([*TINY, *DEEPSEEK, "--log-json", str(ref)]))
    assert "mtp_1 loss: " in out
    a = read_metrics(ref)
    assert sorted(a) == [1, 2, 3, 4]

    ck = tmp_path / "ck"
    check(run_training([*TINY, *DEEPSEEK, "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--expert-model-parallel-size", "2",
                        "--zero-stage", "1", "--save", str(ck), "--save-interval", "2",
                        "--log-json", str(got_a)], nproc=4))
    _compare(a, read_metrics(got_a), [1, 2, 3, 4], "tp2-sp-ep2-z1")

    (ck / "latest_checkpointed_iteration.txt").write_text("2")  # resume from iteration 2
    check(run_training([*TINY, *DEEPSEEK, "--pipeline-model-parallel-size", "2",
                        "--context-parallel-size", "2", "--zero-stage", "3", "--load", str(ck),
                        "--log-json", str(got_b)], nproc=4))
    b = read_metrics(got_b)
    assert sorted(b) == [3, 4]
    _compare(a, b, [3, 4], "pp2-cp2-z3 resumed")

    # the MTP loss reaches the gradients: without its weight the grad norm is another
    off = tmp_path / "off.jsonl"
    check(run_training([*TINY, *DEEPSEEK, "--mtp-loss-scaling-factor", "0", "--train-iters",
                        "1", "--lr-warmup-iters", "0", "--log-json", str(off)]))
    assert read_metrics(off)[1]["grad-norm"] != pytest.approx(a[1]["grad-norm"], rel=1e-3)
