"""Peak memory of the vocab-parallel cross-entropy, in fp32 copies of the logits.

    PYTHONPATH=$PWD python bench/cross_entropy_memory.py [--tokens 1024] [--vocab 32768]

Four gloo ranks run tp 1, 2 and 4. For fp32 logits handed over to the loss (as the model hands
them, ``inplace=True``) and bf16 logits, the loss's forward and backward run under
``LiveStorageBytes`` (megazero.testing.planner_validate: every storage an operator returns, until
it is freed); the logits are dropped after forward as the model drops them. Reported, as multiples
of one fp32 copy of the rank's logits (``4 x tokens x V/t`` bytes):

* ``peak extra``: the peak live bytes beyond the logits themselves;
* ``saved``: the bytes autograd keeps for backward (what the activation meter and the
  planner's ``4 s b V/t`` count).

``copying`` is the previous out-of-place formulation (shifted logits, exponentials and a
gradient clone as separate tensors), kept here as the baseline. Writes
``bench/results/cross_entropy_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.testing import run_distributed  # noqa: E402


class _Copying(torch.autograd.Function):
    """The out-of-place baseline: same arithmetic, a new tensor at every step."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        dtype, logits = logits.dtype, logits.float()
        local = logits.shape[-1]
        start = dist.get_rank(group) * local if group is not None else 0
        m = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        outside = (labels < start) | (labels >= start + local)
        idx = (labels - start).masked_fill(outside, 0)
        pred = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        both = torch.stack([pred, exp.sum(dim=-1)])
        if group is not None:
            dist.all_reduce(both, group=group)
        ctx.dtype = dtype
        ctx.save_for_backward(exp.div_(both[1].unsqueeze(-1)), outside, idx)
        return both[1].log() - both[0]

    @staticmethod
    def backward(ctx, g):
        softmax, outside, idx = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(g.unsqueeze(-1)).to(ctx.dtype), None, None


def _measure(topo, tokens, vocab, dtype, method):
    from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megazero.testing.activation_memory import SavedTensorCounter
    from megazero.testing.planner_validate import LiveStorageBytes

    gen = torch.Generator().manual_seed(topo.tp_rank)
    local = vocab // topo.tp_size
    leaf = torch.randn(tokens, local, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1))
    group = topo.tp_group if topo.tp_size > 1 else None
    with LiveStorageBytes() as meter:
        logits = leaf.clone()
        nbytes = logits.numel() * logits.element_size()
        with meter.window(), SavedTensorCounter() as saved:
            if method == "in place":
                loss = vocab_parallel_cross_entropy(logits, labels, group, inplace=True)
            else:
                loss = _Copying.apply(logits, labels, group)
            del logits
            loss.backward(torch.ones(tokens))
    copy = 4 * tokens * local
    return dict(tp=topo.tp_size, dtype=str(dtype).replace("torch.", ""), method=method,
                peak_extra_copies=(meter.peak - nbytes) / copy,
                saved_copies=saved.total_bytes / copy, fp32_copy_mib=copy / 2**20)


def _world(rank, world, tokens, vocab):
    from megazero.distributed.topology import ParallelTopology

    rows = []
    for tp in (1, 2, 4):
        topo = ParallelTopology.build(tp=tp)
        for dtype in (torch.float32, torch.bfloat16):
            for method in ("copying", "in place"):
                rows.append(_measure(topo, tokens, vocab, dtype, method))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    rows = run_distributed(_world, 4, args.tokens, args.vocab, timeout=900)[0]
    print(f"tokens {args.tokens}, vocab {args.vocab}; in fp32 copies of one rank's logits")
    print(f"{'tp':>3} {'dtype':>9} {'method':>9} {'peak extra':>11} {'saved':>7} "
          f"{'1 copy MiB':>11}")
    for r in rows:
        print(f"{r['tp']:>3} {r['dtype']:>9} {r['method']:>9} {r['peak_extra_copies']:>11.3f} "
              f"{r['saved_copies']:>7.3f} {r['fp32_copy_mib']:>11.1f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "cross_entropy_memory.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
