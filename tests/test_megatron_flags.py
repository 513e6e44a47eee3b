"""Megatron flags that users pass every day, with Megatron's meaning: batch-size ramp-up,
end-of-document loss masking, partial rotary, manual GC, the distributed optimizer, Megatron's
default tokenizer, and every unknown flag of a command line named in one message."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch

from megazero.config import ConfigError, load_config
from megazero.config.rules import check_rampup, rampup_batch_size
from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.model.positional import RotaryEmbedding, apply_rotary
from megazero.testing.distributed import run_distributed
from megazero.testing.launch import TINY, check, read_metrics, run_training
from megazero.training.builders import Batching, get_batch


def test_rampup_follows_megatrons_formula():
    # Megatron: START 16, INCREMENT 16 to 1536 over 5,859,375 samples: 95 increments, one
    # every 61,677.6 samples.
    ramp = (16, 16, 5859375)
    assert rampup_batch_size(ramp, 1536, 0) == 16
    assert rampup_batch_size(ramp, 1536, 61677) == 16
    assert rampup_batch_size(ramp, 1536, 61678) == 32
    assert rampup_batch_size(ramp, 1536, 5859374) == 1520
    assert rampup_batch_size(ramp, 1536, 5859375) == 1536
    assert rampup_batch_size(ramp, 1536, 10**9) == 1536
    assert check_rampup((4, 4, 40), 16, 2, 1) == [4, 8, 12, 16]
    with pytest.raises(ConfigError, match="global - START = 10 is not a multiple of 4"):
        check_rampup((6, 4, 40), 16, 2, 1)
    with pytest.raises(ConfigError, match="global batch 6 of the ramp is not a multiple of "
                                          "--micro-batch-size 2 x data-parallel size 2 = 4"):
        check_rampup((6, 10, 40), 16, 2, 2)
    with pytest.raises(ConfigError, match="--rampup-batch-size 4 4 40: the ramp must reach"):
        load_config([*TINY, "--global-batch-size", "18", "--rampup-batch-size", "4", "4", "40",
                     "--micro-batch-size", "2", "--train-iters", "3"], 1)


def test_rampup_iterations_and_samples():
    cfg = load_config([*TINY, "--global-batch-size", "16", "--micro-batch-size", "2",
                       "--rampup-batch-size", "4", "4", "40", "--train-samples", "100"], 1)
    b = Batching.from_config(cfg, 1)
    # 4 4 4 4 (consumed 16 >= 13.3) 8 8 (32 >= 26.7) 12 (44 >= 40) 16 ... : whole batches <= 100
    sizes, consumed = [], 0
    for _ in range(b.train_iters):
        sizes.append(b.global_batch_at(consumed))
        consumed += sizes[-1]
    assert sizes == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16] and consumed == 92, sizes
    assert b.global_batch_at(consumed) + consumed > 100  # one more would pass --train-samples
    assert [b.microbatches_at(c) for c in (0, 16, 40)] == [2, 4, 8]
    assert b.sampler_batch == 2


def _run(args, tmp_path, name):
    log = tmp_path / f"{name}.jsonl"
    check(run_training([*args, "--log-json", str(log)]))
    return read_metrics(log)


def test_rampup_run_draws_the_same_samples_as_constant_batches(tmp_path):
    base = [*TINY, "--micro-batch-size", "2", "--lr-warmup-iters", "0", "--lr-decay-style",
            "constant", "--eval-iters", "0"]
    ramp = _run([*base, "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "8",
                 "--train-iters", "4"], tmp_path, "ramp")
    assert [r["batch-size"] for r in ramp.values()] == [4, 4, 8, 8]
    assert [r["consumed_samples"] for r in ramp.values()] == [4, 8, 16, 24]
    # Its first two iterations are those of a run at a constant global batch of 4.
    small = _run([*base, "--global-batch-size", "4", "--train-iters", "2"], tmp_path, "small")
    for it in (1, 2):
        assert ramp[it]["lm loss"] == small[it]["lm loss"], it


def test_partial_rotary_rotates_the_leading_dims_only():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, 8)
    full = RotaryEmbedding(8, 16)
    half = RotaryEmbedding(4, 16)
    cos, sin = half(5, x.dtype)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)
    ref = apply_rotary(x[..., :4].contiguous(), cos, sin)
    torch.testing.assert_close(out[..., :4], ref, rtol=0, atol=0)
    cos8, sin8 = full(5, x.dtype)
    assert not torch.equal(apply_rotary(x, cos8, sin8)[..., 4:], x[..., 4:])
    cfg = load_config([*TINY, "--position-embedding-type", "rope", "--rotary-percent", "0.5",
                       "--train-iters", "1"], 1)
    assert cfg.model.rotary_dim == 4
    with pytest.raises(ConfigError, match="--rotary-percent 0.3"):
        load_config([*TINY, "--rotary-percent", "0.3", "--train-iters", "1"], 1)


def test_eod_mask_loss_masks_the_token_after_an_end_of_document():
    tokens = torch.tensor([[5, 9, 0, 7, 0, 3]])
    batch = get_batch(iter([{"tokens": tokens}]), eod_mask=0)
    assert batch["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]
    assert "loss_mask" not in get_batch(iter([{"tokens": tokens}]))


def test_eod_mask_loss_changes_the_loss_as_megatron_does(tmp_path):
    """A corpus whose documents end in EOD: with --eod-mask-loss the loss leaves out the
    prediction made from each EOD, so it differs from the unmasked one, and its value is the
    mean over the remaining tokens (checked with the flag on a corpus without EOD: equal)."""
    from megazero.testing.hf_models import write_bpe_files

    vocab, merges, size = write_bpe_files(str(tmp_path))
    eod = size - 1
    rng = np.random.default_rng(0)
    prefix = tmp_path / "corpus"
    with IndexedDatasetBuilder(str(prefix), np.uint16) as b:
        for _ in range(60):
            b.add_document(np.append(rng.integers(0, 200, size=int(rng.integers(3, 9))), eod))
        b.finalize()
    args = [*TINY[TINY.index("--num-layers"):], "--data-path", str(prefix), "--vocab-file",
            vocab, "--merge-file", merges, "--train-iters", "2", "--eval-iters", "0",
            "--split", "100,0,0"]
    plain = _run(args, tmp_path, "plain")
    masked = _run([*args, "--eod-mask-loss"], tmp_path, "masked")
    assert plain[1]["lm loss"] != masked[1]["lm loss"]
    assert all(math.isfinite(r["lm loss"]) for r in masked.values())


def _gc_counts(rank, world, args):
    import gc as gc_module

    from megazero.testing.training_runs import train_in_rank

    calls = []
    real = gc_module.collect
    seen_enabled = []

    def counting(*a, **k):
        calls.append(1)
        seen_enabled.append(gc_module.isenabled())
        return real(*a, **k)

    gc_module.collect = counting
    try:
        train_in_rank(rank, world, args)
    finally:
        gc_module.collect = real
    return len(calls), any(seen_enabled), gc_module.isenabled()


def test_manual_gc_collects_every_interval_with_automatic_gc_off():
    from megazero.testing.training_runs import TINY as RANK_TINY

    args = [*RANK_TINY, "--train-iters", "6", "--manual-gc", "--manual-gc-interval", "2"]
    (count, enabled_during, enabled_after), = run_distributed(_gc_counts, 1, args)
    assert count == 1 + 3 and not enabled_during and enabled_after  # start, then 2, 4, 6
    (count, _, _), = run_distributed(_gc_counts, 1, [*RANK_TINY, "--train-iters", "6"])
    assert count == 0
    assert gc.isenabled()


def test_distributed_optimizer_is_zero_1_unless_the_stage_is_given():
    assert load_config([*TINY, "--use-distributed-optimizer", "--train-iters", "1"],
                       1).zero.stage == 1
    assert load_config([*TINY, "--use-distributed-optimizer", "--zero-stage", "2",
                        "--train-iters", "1"], 1).zero.stage == 2


def test_every_unknown_flag_in_one_message():
    with pytest.raises(ConfigError) as e:
        load_config([*TINY, "--fp32-residual-connection", "--bogus-flag", "3", "--batch-size", "4",
                     "--seq-lenght", "8", "--train-iters", "1"], 1)
    msg = str(e.value)
    assert msg.startswith("command line: 4 arguments are not megazero's, all listed here: ")
    for part in ("(1) --fp32-residual-connection is not a megazero flag; use nothing: residuals",
                 "(2) unknown argument '--bogus-flag'", "(3) --batch-size is not a megazero "
                 "flag; use --micro-batch-size", "(4) unknown argument '--seq-lenght'; did you "
                 "mean --seq-length?"):
        assert part in msg, msg
    assert "'3'" not in msg  # the value belongs to its flag


def test_accepted_megatron_flags():
    cfg = load_config([*TINY, "--cross-entropy-loss-fusion", "--ckpt-format", "torch_dist",
                       "--overlap-p2p-communication", "--train-iters", "1"], 1)
    assert cfg.train.train_iters == 1


def _zeros(rank, world, args):
    from megazero.testing.training_runs import train_in_rank

    _, run = train_in_rank(rank, world, args, keep_run=True)
    return [h.get("num_zeros") for h in run.state.history]


def test_num_zeros_in_grad_is_the_models_count_at_any_layout():
    """Input-embedding rows (untied) of tokens absent from a batch get exactly zero gradient:
    the count is at least those rows' elements, and the same at dp 1 and at tp 2 x dp 2 with
    ZeRO-2 (each element counted once; a sum's rounding makes a few other elements exactly
    zero in one layout and not the other, observed 1-2 of 12,500)."""
    from megazero.testing.training_runs import TINY as RANK_TINY

    args = [*RANK_TINY, "--train-iters", "2", "--untie-embeddings-and-output-weights",
            "--log-num-zeros-in-grad", "--vocab-size", "512"]
    one = run_distributed(_zeros, 1, args)[0]
    many = run_distributed(_zeros, 4, [*args, "--tensor-model-parallel-size", "2",
                                       "--zero-stage", "2"])
    assert all(z is not None for z in one)
    # 512 tokens, a batch of 8 x 17 draws at most 136 of them: >= 376 rows of 32 are zero
    assert all(z >= 376 * 32 for z in one), one
    for rank_counts in many:
        assert all(abs(a - b) <= 8 for a, b in zip(rank_counts, one)), (rank_counts, one)
    assert many[0] == many[1] == many[2] == many[3]  # one number for the whole model
    assert run_distributed(_zeros, 1, args[:-3] + ["--vocab-size", "512"])[0] == [None, None]
