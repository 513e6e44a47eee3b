"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each rank holds ``logits[..., V/t]``. Three all-reduces over the TP group of tensors the size of
the labels (not of the logits) give the exact loss: the global max (for numerical stability),
the target logit (only the rank owning the label contributes), and the sum of exponentials.
The softmax is kept for backward, where the gradient ``softmax - onehot`` is purely local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.tensor_parallel.mappings import Group, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group):
        dtype = logits.dtype
        logits = logits.float()
        world = group_size(group)
        local = logits.shape[-1]
        start = group_rank(group) * local

        logits_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (labels < start) | (labels >= start + local)
        local_labels = (labels - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.dtype = dtype
        ctx.save_for_backward(softmax, outside, local_labels)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_labels = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Group
                                 ) -> torch.Tensor:
    """Per-token loss (fp32, shape of ``labels``) from vocab-parallel ``logits``.

    Padded vocabulary columns must hold ``-inf`` (the model masks them), so they carry zero
    probability and the loss equals the unpadded tp=1 loss.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group)
