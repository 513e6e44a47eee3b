"""Cross-entropy over logits split along the vocabulary, without gathering or copying them.

Each rank holds ``logits[..., V/t]``. Three all-reduces over the TP group of tensors the size of
the labels (not of the logits) give the exact loss: the global max (for numerical stability),
the target logit (only the rank owning the label contributes), and the sum of exponentials.

Memory, as in Megatron: the logits are the largest activation of a GPT (4 bytes x tokens x
V/t in fp32: 4.2 GB for a 128k vocabulary at 4 x 2048 tokens), so the loss works in one fp32
buffer. It is the logits themselves when they are fp32 and the caller gives them up
(``inplace=True``, as the model does: the output layer's backward does not need its output),
otherwise one fp32 copy (the cast of 16-bit logits, or a clone). That buffer is shifted by the
max, exponentiated and normalised in place into the softmax saved for backward, and backward
turns it in place into the gradient ``(softmax - onehot) * grad_loss``. Peak extra memory:
at most one fp32 copy of the logits, plus per-token vectors.

In-place work on the caller's logits bumps their autograd version counter, so anything else
that saved them for backward fails loudly ("modified by an inplace operation") instead of
computing a wrong gradient. Backward consumes the saved softmax the same way: a second backward
through one graph (``retain_graph=True``) raises that error too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.tensor_parallel.mappings import Group, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, inplace):
        dtype = logits.dtype
        if dtype != torch.float32:
            buf = logits.float()  # the one fp32 copy; the 16-bit logits are the caller's
        else:
            buf = logits if inplace else logits.clone()
        world = group_size(group)
        local = buf.shape[-1]
        start = group_rank(group) * local

        logits_max = buf.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        buf.sub_(logits_max.unsqueeze(-1))  # shifted logits

        outside = (labels < start) | (labels >= start + local)
        local_labels = (labels - start).masked_fill(outside, 0)
        predicted = buf.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        buf.exp_()
        sum_exp = buf.sum(dim=-1)
        if world > 1:
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted

        buf.div_(sum_exp.unsqueeze(-1))  # the softmax, kept for backward
        ctx.dtype = dtype
        ctx.save_for_backward(buf, outside, local_labels)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad, outside, local_labels = ctx.saved_tensors  # the softmax, overwritten in place
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Group,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token loss (fp32, shape of ``labels``) from vocab-parallel ``logits``.

    Padded vocabulary columns must hold ``-inf`` (the model masks them), so they carry zero
    probability and the loss equals the unpadded tp=1 loss.

    ``inplace=True``: fp32 ``logits`` are overwritten (with the softmax, then the gradient)
    instead of copied; pass it only when nothing reads them afterwards. 16-bit logits are
    never modified (their fp32 cast is the working buffer either way).
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, inplace)
