"""megazero.initialize: a DeepSpeed training loop on megazero's ZeRO engine.

Multi-rank cases run in gloo worlds on CPU (one world per rank count runs every case in
sequence, since starting ranks is the slow part); rank functions live in
megazero/testing/engine_runs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megazero.testing import engine_runs as R
from megazero.testing import engine_state_runs as S
from megazero.testing.distributed import preload, run_distributed

# Every rank builds a Hugging Face model: import transformers once, in the forkserver.
preload("transformers", "transformers.models.gpt2.modeling_gpt2")

CASES = [(0, False), (1, False), (2, False), (3, False), (2, True)]  # (stage, offload cpu)
STEPS = 3
# fp32 on both sides; the sharded runs sum gradients in another order than the one-process
# reference, so losses agree to rounding (measured: at most 9e-7 over these 3 steps).
TOL = 5e-6


@pytest.mark.parametrize("world", [2, 4])
def test_loop_matches_one_process_adamw(world):
    """Losses of the DeepSpeed loop (gas 2, clipping 0.5, WarmupLR, weight decay) on a Hugging
    Face GPT2LMHeadModel and a plain module, at ZeRO 0/1/2/3 and 2 + cpu offload, equal a
    one-process torch.optim.AdamW loop on the whole batch."""
    kinds = ("hf", "plain")
    res = run_distributed(R.equivalence_world, world, kinds, CASES, STEPS, timeout=240)
    for kind in kinds:
        ref_norms: list[float] = []
        ref = R.reference_losses(kind, STEPS, world, norms=ref_norms)
        assert ref[0] != ref[-1]
        for case in CASES:
            got = R.mean_over_ranks([r[(kind, *case)] for r in res])
            assert max(abs(a - b) for a, b in zip(got, ref)) < TOL, (kind, case, got, ref)
            # the norm before clipping: the gradient is the mean over the global batch
            norms = R.grad_norms([r[(kind, *case)] for r in res])
            assert norms == pytest.approx(ref_norms, rel=1e-5), (kind, case, norms, ref_norms)


def test_fp16_overflow_skip_and_out_of_order_errors():
    res = run_distributed(S.fp16_and_errors_world, 2, timeout=180)
    for r in res:
        assert r["applied0"] and r["scale0"] == 256.0
        # rank 1 alone saw inf: every rank skips, the scale halves, nothing moves
        assert not r["applied1"] and r["scale1"] == 128.0
        assert r["unchanged1"] and r["lr_held"]
        assert r["skipped"] == 1 and r["global_steps"] == 2
        assert r["applied2"] and r["changed2"] and r["lr_moved"]
        errors = r["errors"]
        assert set(errors) == {"step_without_backward", "backward_twice", "backward_in_eval",
                               "eval_forward_then_backward", "loss_without_grad"}
        assert "without engine.backward()" in errors["step_without_backward"]
        assert "twice without engine.step()" in errors["backward_twice"]
        assert "eval mode" in errors["backward_in_eval"]
        assert "forward that ran in eval mode" in errors["eval_forward_then_backward"]
        assert r["recovered_steps"] == 1
        cfg = r["cfg_errors"]
        if r is res[0]:  # steps_per_print 1: rank 0 logs every step (with wall_clock_breakdown)
            log = r["log"]
            assert len(log) == 3 and all(f"step={i + 1} " in log[i] for i in range(3)), log
            assert "loss_scale=256 skipped=0" in log[0] and "skipped=1" in log[1]
            assert "grad_norm=nan" in log[1] and "loss=" in log[0] and "ms" in log[0]
        else:
            assert r["log"] == []
        assert set(cfg) == {"one_cycle", "optimizer_twice", "rmsprop", "no_optimizer", "bad_triad"}
        assert "OneCycle" in cfg["one_cycle"] and "WarmupLR" in cfg["one_cycle"]
        assert "given twice" in cfg["optimizer_twice"]
        assert "RMSprop" in cfg["rmsprop"] and "AdamW" in cfg["rmsprop"]
        assert '"optimizer" block' in cfg["no_optimizer"]
        assert "train_batch_size 7" in cfg["bad_triad"]


def test_checkpoint_resume_and_reshard(tmp_path):
    """save/load with client_state resumes exactly at the same layout; loaded at dp 4 and ZeRO 3
    (saved at dp 2, ZeRO 1) it continues with the same losses to rounding."""
    root = str(tmp_path / "ckpt")
    saved = run_distributed(S.checkpoint_world, 2, root, "save", timeout=180)
    rest = R.mean_over_ranks([r["rest"] for r in saved])
    for r in saved:
        assert r["client"]["step"] == 2 and r["client"]["note"] == "two"
        assert r["client"]["t"] == [0, 1, 2]  # a tensor in client_state, read back
        assert r["counters"] == (2, 16, 4)
        assert r["path"].endswith("step2")
        assert r["resumed_lr4"] == r["lr4"]
        assert r["latest_client"] == {"step": 4} and r["latest_steps"] == 4
    assert R.mean_over_ranks([r["resumed"] for r in saved]) == rest  # bitwise at same layout
    assert open(f"{root}/latest").read() == "step4"
    moved = run_distributed(S.checkpoint_world, 4, root, "reshard", timeout=180)
    got = R.mean_over_ranks([r["resumed"] for r in moved])
    assert max(abs(a - b) for a, b in zip(got, rest)) < TOL, (got, rest)
    assert moved[0]["client"]["step"] == 2 and moved[0]["resumed_lr4"] == saved[0]["lr4"]
    assert "client_state['fn'] is a builtin_function_or_method" in saved[0]["client_state_error"]
    assert not (tmp_path / "ckpt" / "bad").exists()


def test_client_optimizer_scheduler_and_bf16():
    """A client AdamW with two groups + a LambdaLR object (ZeRO 3), the config's AdamW + a
    StepLR from a callable (ZeRO 1): the same losses and learning rates as the one-process
    loop with those objects. bf16 (ZeRO 2): bf16 weights, fp32 masters, losses near fp32's."""
    res = run_distributed(R.client_and_bf16_world, 2, timeout=180)
    for key, optim in (("client", R.client_optim), ("callable", R.json_optim_step_lr)):
        ref = R.reference_losses("plain", 3, 2, optim=optim)
        got = R.mean_over_ranks([r[key] for r in res])
        assert max(abs(a - b) for a, b in zip(got, ref)) < TOL, (key, got, ref)
    assert res[0]["client_lrs"] == [R.LR / 4, R.LR / 4]  # LambdaLR 1 / (s + 1) after 3 steps
    assert res[0]["callable_lrs"] == [R.LR / 8]
    assert res[0]["bf16_dtypes"] == ({"torch.bfloat16"}, {"torch.float32"})
    for r in res:  # GatheredParameters(modifier_rank=0) at stage 2: weights and fp32 masters
        assert r["bf16_modified"][0] == [0.5]
        assert r["bf16_modified"][1] in ([0.5], [])  # [] where this rank owns no master piece
    assert any(r["bf16_modified"][1] == [0.5] for r in res)
    ref = R.reference_losses("plain", 3, 2)
    got = R.mean_over_ranks([r["bf16"] for r in res])
    # bf16 keeps 8 mantissa bits: the loss (~4.7) to within a few of its ulps (0.03)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 0.05, (got, ref)


def test_zero_init_partitions_and_gathers():
    res = run_distributed(S.init_world, 2, timeout=180)
    ref = R.build("plain")
    full = sum(p.numel() for p in ref.parameters())
    per_rank = sum(math.ceil(p.numel() / 2) for p in ref.parameters())
    for r in res:
        assert r["empty"] and r["empty_after"] and r["late_empty"] and r["outside_full"]
        assert r["stored"] == per_rank and per_rank <= full / 2 + len(list(ref.parameters()))
        assert r["stack_live"] == [0, 0, 0, 0]  # each layer is cut as soon as it is built
        for n, p in ref.named_parameters():
            assert torch.equal(torch.from_numpy(r["gathered"][n]), p.detach()), n
            assert torch.equal(torch.from_numpy(r["stage1_full"][n]), p.detach()), n
        assert torch.equal(torch.from_numpy(r["bias_after"]), torch.ones_like(ref.head.bias))
        assert torch.equal(torch.from_numpy(r["full"]["head.bias"]),
                           torch.full_like(ref.head.bias, 0.25))
        assert torch.equal(torch.from_numpy(r["full"]["head.weight"]), ref.head.weight.detach())
    want = R.reference_losses("plain", 2, 2, modify=lambda m: m.head.bias.fill_(0.25))
    got = R.mean_over_ranks([r["losses"] for r in res])
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL, (got, want)
