"""``pretrain_gpt.py`` with the DeepSeek-V3 shape (multi-latent attention, one
multi-token-prediction depth, group-limited sigmoid routing with the expert bias, a dense first
layer, a shared expert, untied embeddings) trains the same model at every layout: TP 2 + SP x
EP 2 x DP 2 with ZeRO 3 (MTP reads the partitioned word embedding outside its module), and
PP 2 x CP 2 with ZeRO 1 resumed from the first layout's checkpoint at iteration 2 (the last
stage's copy of the embedding loaded from the word embedding) give the one-process run's
``lm loss``, ``mtp_1 loss`` and grad norms to fp32 rounding. The MTP loss reaches the
gradients: the model's MTP depth changes them (checked in process)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

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
                        "--zero-stage", "3", "--save", str(ck), "--save-interval", "2",
                        "--log-json", str(got_a)], nproc=4))
    _compare(a, read_metrics(got_a), [1, 2, 3, 4], "tp2-sp-ep2-dp2-z3")

    (ck / "latest_checkpointed_iteration.txt").write_text("2")  # resume from iteration 2
    check(run_training([*TINY, *DEEPSEEK, "--pipeline-model-parallel-size", "2",
                        "--context-parallel-size", "2", "--zero-stage", "1", "--load", str(ck),
                        "--log-json", str(got_b)], nproc=4))
    b = read_metrics(got_b)
    assert sorted(b) == [3, 4]
    _compare(a, b, [3, 4], "pp2-cp2-z1 resumed")


def test_mtp_loss_reaches_the_gradients():
    """The back-propagated loss carries ``factor / N`` times the depths' losses: the trunk's
    gradients move with the factor, the reported value does not."""
    from megazero.config import load_config
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.model.mtp import add_mtp_loss, mtp_loss_masks

    cfg = load_config([*TINY, *DEEPSEEK])
    seq = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:]}
    batch["mtp_loss_mask"] = mtp_loss_masks(None, batch["tokens"], 1)
    grads, values = [], []
    for factor in (0.0, 0.3):
        m = replace(cfg.model, mtp_loss_scaling_factor=factor)
        model = GPTModel(m, ParallelTopology.single(), seed=3)
        per_token = model(batch["tokens"], batch["labels"])
        loss = add_mtp_loss(per_token.mean(), model, batch, ParallelTopology.single())
        loss.backward()
        values.append(float(loss.detach()))
        grads.append(model.decoder.layers["0"].self_attention.linear_proj.weight.grad.clone())
        assert len(model.mtp.tracked) == 1 and float(model.mtp.tracked[0][0]) > 0
    assert values[0] == values[1]
    assert not torch.allclose(grads[0], grads[1])


def test_deepseek_shape_under_the_v_schedule_keeps_mtp_on_rank_0(tmp_path):
    """Under ZBV the output layer, the loss and the MTP depth live on rank 0's second chunk
    (virtual stage 2p-1): the same ``lm loss``, ``mtp_1 loss`` and grad norms as one
    process."""
    four = ["--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]"]
    ref, got = tmp_path / "ref.jsonl", tmp_path / "zbv.jsonl"
    check(run_training([*TINY, *DEEPSEEK, *four, "--log-json", str(ref)]))
    check(run_training([*TINY, *DEEPSEEK, *four, "--pipeline-model-parallel-size", "2",
                        "--pipeline-schedule", "zbv", "--log-json", str(got)], nproc=2))
    _compare(read_metrics(ref), read_metrics(got), [1, 2, 3, 4], "pp2-zbv")
