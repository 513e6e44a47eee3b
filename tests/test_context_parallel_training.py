"""Training with context parallelism is training the same model as one process.

Runs go through :func:`megazero.training.lifecycle.setup` and ``train`` (what ``pretrain_gpt.py``
runs) in spawned gloo worlds, and one through ``pretrain_gpt.py`` under torchrun. Against the
one-process run of the same flags: losses, grad norms and the saved weights (read back as
global tensors) at CP 2 x TP 2 + SP x PP 2 (interleaved) x ZeRO 1 (RoPE, GQA, --mock-data)
and at CP 4 with ZeRO 3 (learned positions, the demo corpus with --eod-mask-loss); a
checkpoint saved at CP 2 resumes at CP 1 and at CP 4 (all-gather, selective recompute) with
the losses of the uninterrupted run. The exact loss over a CP-split micro-batch with one shard
entirely masked is checked on its own.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from megazero.checkpoint.shard_reader import read_model_state
from megazero.testing import run_distributed
from megazero.testing.launch import check, read_metrics, run_training

BASE = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--lr-decay-iters", "100", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "0",
        "--seed", "7", "--distributed-backend", "gloo", "--train-iters", "4"]
MOCK = [*BASE, "--mock-data", "--position-embedding-type", "rope", "--group-query-attention",
        "--num-query-groups", "2"]
LOSS_RTOL, NORM_RTOL = 2e-6, 1e-5


def _train(rank, world, args):
    from megazero.config import load_config
    from megazero.training.lifecycle import setup
    from megazero.training.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    run = setup(load_config(args, world))
    try:
        state = train(run)
    finally:
        run.close()
    return {int(h["iteration"]): (h["loss"], h["grad_norm"]) for h in state.history}


def _run(args, world):
    return run_distributed(_train, world, args, timeout=300)[0]


def _same_run(ref, got, ref_ckpt=None, got_ckpt=None):
    assert sorted(got) == sorted(ref)
    for it, (loss, norm) in ref.items():
        assert got[it][0] == pytest.approx(loss, rel=LOSS_RTOL, abs=0), it
        assert got[it][1] == pytest.approx(norm, rel=NORM_RTOL, abs=0), it
    if ref_ckpt is not None:
        _, a = read_model_state(str(ref_ckpt))
        _, b = read_model_state(str(got_ckpt))
        assert sorted(a) == sorted(b) and len(a) > 10
        for name in a:
            scale = a[name].abs().max().item()
            assert (a[name] - b[name]).abs().max().item() <= 2e-6 * max(scale, 1.0), name


def test_cp2_tp2_sp_pp2_zero1_equals_one_process_and_resumes_at_cp1_and_cp4(tmp_path):
    ref = _run([*MOCK, "--save", str(tmp_path / "ref"), "--save-interval", "4"], 1)
    ck = tmp_path / "cp2"
    got = _run([*MOCK, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1", "--zero-stage", "1",
                "--save", str(ck), "--save-interval", "2"], 8)
    _same_run(ref, got, tmp_path / "ref", ck)
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    for cp, comm in ((1, "p2p"), (4, "all_gather")):
        resumed = _run([*MOCK, "--context-parallel-size", str(cp), "--cp-comm-type", comm,
                        "--zero-stage", "1", "--recompute-granularity", "selective",
                        "--load", str(ck)], cp)
        _same_run({it: ref[it] for it in (3, 4)}, resumed)


def test_cp4_zero3_through_pretrain_gpt_on_the_demo_corpus_equals_one_process(tmp_path):
    # the demo corpus and its tokenizer; --eod-mask-loss masks CP shards unevenly
    demo = [*BASE[2:], "--data-cache-path", str(tmp_path / "cache"), "--eod-mask-loss"]
    ref = _run([*demo, "--save", str(tmp_path / "ref"), "--save-interval", "4"], 1)
    log = tmp_path / "cp4.jsonl"
    check(run_training([*demo, "--context-parallel-size", "4", "--zero-stage", "3",
                        "--log-interval", "1", "--log-json", str(log),
                        "--save", str(tmp_path / "cp4"), "--save-interval", "4"], nproc=4,
                       timeout=300))
    got = {it: (r["lm loss"], r["grad-norm"]) for it, r in read_metrics(log).items()}
    _same_run(ref, got, tmp_path / "ref", tmp_path / "cp4")


def _masked_loss(rank, world):
    from megazero.context_parallel.loss import exact_mean_loss
    from megazero.context_parallel.split import split

    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(3)
    per_token = torch.rand(2, 16, generator=g) * 5
    out = {}
    for name, mask in (("uneven", (torch.rand(2, 16, generator=g) > 0.3).float()),
                       ("rank 0 all masked", torch.cat([torch.zeros(2, 4), torch.ones(2, 8),
                                                        torch.zeros(2, 4)], dim=1))):
        x = per_token.clone().requires_grad_()
        ref = (x * mask).sum() / mask.sum()
        ref.backward()
        mine = split(per_token, 1, rank, world).requires_grad_()
        loss = exact_mean_loss(mine, split(mask, 1, rank, world), group)
        loss.backward()
        # the optimizer averages parameter gradients over the CP group: each rank's share of
        # the per-token gradient is CP times its share of the exact mean's
        grad_err = (mine.grad / world - split(x.grad, 1, rank, world)).abs().max().item()
        out[name] = (loss.item(), ref.item(), grad_err,
                     math.isfinite(loss.item()) and bool(torch.isfinite(mine.grad).all()))
    return out


def test_exact_loss_over_a_split_with_a_fully_masked_shard():
    for rank_out in run_distributed(_masked_loss, 2, timeout=60):
        for name, (loss, ref, grad_err, finite) in rank_out.items():
            assert finite, name
            assert loss == pytest.approx(ref, rel=1e-6), name
            assert grad_err < 1e-7, name
