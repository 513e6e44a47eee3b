"""The vocab-parallel cross-entropy works in at most one fp32 copy of the logits.

One spawned world of 4 gloo ranks runs tp 1, 2 and 4 (a TP group of each size), fp32 logits
given up to the loss (``inplace=True``, as the model passes them) and kept by the caller, and
bf16 / fp16 logits. For each case:

* the per-token loss and the logits' gradient equal the dense ``F.cross_entropy`` of the full
  (unsharded) logits to fp32 rounding (16-bit gradients to their own rounding), with padded
  vocabulary columns at ``-inf`` and targets on every rank;
* the peak bytes of live tensor storage
  (``megazero.testing.planner_validate.LiveStorageBytes``, which sees every storage an
  operator returns until it is freed) from the moment the logits exist through forward and
  backward: at most the logits themselves plus one fp32 copy plus
  per-token vectors; with fp32 logits given up, no copy at all. The logits are dropped after
  forward as the model drops them (it keeps only the loss);
* the bytes autograd saves for backward (the activation meter's count, and what the planner
  charges the loss with: ``4 s b V/t``) are one fp32 copy of the logits plus per-token vectors.
"""

import torch
import torch.nn.functional as F

from megazero.testing import run_distributed

W, TOKENS, VOCAB, PAD = 4, 24, 1024, 8  # the last PAD columns of the vocabulary are padding
SLACK_PER_TOKEN = 128  # bytes: max, target logit, sum of exponentials, labels, masks, loss


def _case(topo, dtype, inplace):
    from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megazero.testing.activation_memory import SavedTensorCounter
    from megazero.testing.planner_validate import LiveStorageBytes

    tp, r = topo.tp_size, topo.tp_rank
    gen = torch.Generator().manual_seed(5)
    full = (torch.randn(TOKENS, VOCAB, generator=gen) * 20).to(dtype)  # needs the max shift
    full[:, VOCAB - PAD:] = float("-inf")
    labels = torch.randint(0, VOCAB - PAD, (TOKENS,), generator=gen)
    up = torch.rand(TOKENS, generator=gen) + 0.5
    ref_in = full.float().clone().requires_grad_()
    ref = F.cross_entropy(ref_in, labels, reduction="none")
    ref.backward(up)
    local = VOCAB // tp
    cols = slice(r * local, (r + 1) * local)

    leaf = full[:, cols].clone().requires_grad_()
    with LiveStorageBytes() as meter:
        logits = leaf.clone()  # the output layer's output: its backward needs nothing of it
        n = logits.numel()
        with meter.window(), SavedTensorCounter() as saved:
            loss = vocab_parallel_cross_entropy(logits, labels, topo.tp_group, inplace=inplace)
            logits_bytes = n * logits.element_size()
            del logits
            loss.backward(up)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-5)
    want = ref_in.grad[:, cols].to(dtype)
    tol = {} if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(leaf.grad, want, **tol)
    extra = meter.peak - logits_bytes  # measured from the window's start (before the logits)
    copies = 0 if (inplace and dtype == torch.float32) else 1
    slack = SLACK_PER_TOKEN * TOKENS
    assert extra <= copies * 4 * n + slack, (tp, dtype, inplace, extra, 4 * n)
    assert 4 * n <= saved.total_bytes <= 4 * n + slack, (tp, dtype, saved.total_bytes, 4 * n)
    return dict(tp=tp, dtype=str(dtype), inplace=inplace, extra_over_fp32_copy=extra / (4 * n))


def _world(rank, world):
    from megazero.distributed.topology import ParallelTopology

    rows = []
    for tp in (1, 2, 4):
        topo = ParallelTopology.build(tp=tp)
        for dtype, inplace in ((torch.float32, True), (torch.float32, False),
                               (torch.bfloat16, True), (torch.float16, False)):
            rows.append(_case(topo, dtype, inplace))
    return rows


def test_cross_entropy_peak_is_at_most_one_fp32_copy_of_the_logits():
    rows = run_distributed(_world, W, timeout=300)
    assert len(rows[0]) == 12
    for row in rows[0]:  # the in-place fp32 case really holds no copy at all
        if row["inplace"] and row["dtype"] == "torch.float32":
            assert row["extra_over_fp32_copy"] < 0.2, row


def test_planner_charges_the_loss_one_fp32_buffer():
    """The planner's last-stage loss terms are the ones measured above: one fp32 buffer saved
    (``4 s b V/t``, V padded), and only with 16-bit logits the logits beside it."""
    from megazero.config import load_config
    from megazero.planner.activations import embedding_logits_bytes, loss_transient_bytes

    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--vocab-size 1000 --micro-batch-size 2 --mock-data --hidden-dropout 0 "
             "--tensor-model-parallel-size 2").split()
    for extra, elem in (([], 4), (["--bf16"], 2)):
        cfg = load_config(flags + extra, 2)
        local = 32 * 2 * 1024 // 2  # vocab padded to a multiple of 128 x tp
        last_only = (embedding_logits_bytes(cfg, 2, 2, False, True)
                     - embedding_logits_bytes(cfg, 2, 2, False, False))
        norm_and_head_inputs = 2 * elem * 32 * 2 * 64 + 2 * 4 * 32 * 2
        assert last_only - norm_and_head_inputs == 4 * local
        assert loss_transient_bytes(cfg, 2, 2) == (0 if elem == 4 else 2 * local)


def test_inplace_loss_respects_the_autograd_version_counter():
    """Working in the caller's fp32 logits bumps their version: a graph that also saved them
    fails loudly instead of using the overwritten values. 16-bit logits are never modified."""
    import pytest

    from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    labels = torch.tensor([1, 5, 0, 7])
    x = torch.randn(4, 8, requires_grad=True)
    logits = x * 1.0
    kept = logits.sin()  # sin saves its input (the logits) for backward
    loss = vocab_parallel_cross_entropy(logits, labels, None, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss.sum() + kept.sum()).backward()
    logits = x * 1.0
    kept = logits.sin()
    loss = vocab_parallel_cross_entropy(logits, labels, None)  # a copy: both gradients right
    (loss.sum() + kept.sum()).backward()
    ref = x.detach().clone().requires_grad_()
    (F.cross_entropy(ref, labels, reduction="none").sum() + ref.sin().sum()).backward()
    torch.testing.assert_close(x.grad, ref.grad)
    loss = vocab_parallel_cross_entropy(x * 1.0, labels, None, inplace=True)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()  # the softmax became the gradient: no silent second pass
    half = torch.randn(4, 8, dtype=torch.bfloat16)
    before = half.clone()
    vocab_parallel_cross_entropy(half, labels, None, inplace=True)
    assert torch.equal(half, before)
