"""Multi-token prediction (MTP, DeepSeek-V3; megatron-core's ``--mtp-num-layers``).

``N`` modules run after the main model on the chunk that holds the output layer. Module ``k``
(1-based) sees, at position ``i``, the previous depth's output ``h`` (the main model's final,
normed hidden state for ``k = 1``) and the embedding of token ``t_{i+k}``; it normalises both
(``hnorm``, ``enorm``), projects their concatenation ``[e; h]`` back to the hidden width
(``eh_proj``), runs one transformer layer and its own final norm, and the shared output head
predicts ``t_{i+k+1}``. The embedding and the head are the main model's: with tied embeddings
the chunk's copy of the word embedding, as the output layer uses it.

Inputs and targets come from the labels alone (``labels[i] = t_{i+1}``): module ``k`` reads
``labels[i+k-1]`` and predicts ``labels[i+k]``; the last ``k`` positions have no target and
are masked (``mtp_loss_mask``, built with the batch from the loss mask rolled by ``k``, so a
document boundary masks exactly where the main loss masks). Under context parallelism a rank
holds two zigzag chunks of the sequence, so the labels are all-gathered over the CP group (the
tokens are small) and the shifted ones picked by global position.

The loss of module ``k`` is the masked mean of its per-token cross entropy over the
micro-batch (the exact mean over CP ranks, :func:`megazero.context_parallel.loss.
exact_mean_loss`); ``--mtp-loss-scaling-factor / N`` times their sum is added to the main loss
for the backward only (:func:`add_mtp_loss`): the reported ``lm loss`` stays the main loss, and
each module's loss is logged as ``mtp_k loss`` (Megatron's name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megazero.config import ModelConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.init import declare_linear, scope
from megazero.model.norms import build_norm
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.layers import DEFERRED_INIT, ColumnParallelLinear
from megazero.tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)


class MTPLayer(nn.Module):
    """One prediction depth: ``(h [s(/t), b, H], e [s(/t), b, H]) -> [s(/t), b, H]``."""

    def __init__(self, config: ModelConfig, depth: int, parallel: ParallelContext):
        super().__init__()
        from megazero.model.transformer import TransformerLayer

        self.parallel = parallel
        sp = parallel.sequence_parallel
        norm = (config.normalization, config.hidden_size, config.norm_epsilon, sp,
                parallel.params_dtype, config.apply_layernorm_1p)
        self.enorm = scope(build_norm(*norm), "enorm")
        self.hnorm = scope(build_norm(*norm), "hnorm")
        # column-parallel as megatron-core's; gathered back to the hidden width below
        self.eh_proj = ColumnParallelLinear(2 * config.hidden_size, config.hidden_size,
                                            parallel=parallel, bias=False,
                                            init_method=DEFERRED_INIT)
        scope(declare_linear(self.eh_proj), "eh_proj")
        # the layer after the main model's last: its global index keys its init and routing
        self.transformer_layer = scope(
            TransformerLayer(config, config.num_layers + depth, parallel=parallel),
            "transformer_layer")
        self.final_layernorm = scope(build_norm(*norm), "final_layernorm")

    def forward(self, h: torch.Tensor, e: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        p = self.parallel
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))  # [s, b, H/t]
        x = gather_from_tensor_parallel_region(x, p.tp_group)
        if p.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, p.tp_group)
        return self.final_layernorm(self.transformer_layer(x, rotary))


class MultiTokenPrediction(nn.Module):
    """The ``N`` depths, keyed ``layers.<k-1>``, and the losses of the last forward."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        assert config.mtp_num_layers
        self.parallel = parallel
        self.layers = nn.ModuleDict({
            str(k): scope(MTPLayer(config, k, parallel), f"layers.{k}")
            for k in range(config.mtp_num_layers)})
        self.pending: list[torch.Tensor] | None = None  # per-token losses [b, s] per depth
        # the log interval's micro-batches: each one's depth losses, detached on the device
        # (no host sync per micro-batch; summed when the interval is logged)
        self.tracked: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor],
                head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """``hidden``: the main model's normed output; ``labels [b, s]`` this rank's share;
        ``embed(ids [b, s]) -> [s(/t), b, H]``; ``head_loss(x, labels [b, s]) -> [b, s]``.
        Leaves each depth's per-token loss in :attr:`pending`."""
        full, positions = _whole_labels(labels, self.parallel)
        last = full.shape[1] - 1
        losses = []
        x = hidden
        for k, layer in enumerate(self.layers.values(), start=1):
            ids = full[:, (positions + k - 1).clamp(max=last)]
            target = full[:, (positions + k).clamp(max=last)]  # tail: masked by the batch
            x = layer(x, embed(ids), rotary)
            losses.append(head_loss(x, target))
        self.pending = losses


def _whole_labels(labels: torch.Tensor, parallel: ParallelContext
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels of the whole sequence [b, S], this rank's positions [s])``."""
    if parallel.cp_size == 1:
        return labels, torch.arange(labels.shape[1], device=labels.device)
    from megazero.context_parallel.split import local_positions

    cp, seq = parallel.cp_size, labels.shape[1] * parallel.cp_size
    parts = [torch.empty_like(labels) for _ in range(cp)]
    dist.all_gather(parts, labels.contiguous(), group=parallel.cp_group)
    full = torch.empty(labels.shape[0], seq, dtype=labels.dtype, device=labels.device)
    for r, part in enumerate(parts):
        full[:, local_positions(seq, r, cp, labels.device)] = part
    return full, local_positions(seq, parallel.cp_rank, cp, labels.device)


def mtp_loss_masks(loss_mask: torch.Tensor | None, tokens: torch.Tensor, depths: int
                   ) -> torch.Tensor:
    """``[b, s, N]``: depth ``k``'s mask at ``i`` is the loss mask at ``i + k`` (0 past the
    end). Built from the whole sequence, before any context-parallel split."""
    mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device) \
        if loss_mask is None else loss_mask.float()
    s = mask.shape[1]
    out = torch.zeros(*mask.shape, depths, dtype=torch.float32, device=mask.device)
    for k in range(1, depths + 1):
        if k < s:
            out[:, :s - k, k - 1] = mask[:, k:]
    return out


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor, cp_group: Any) -> torch.Tensor:
    from megazero.context_parallel.loss import exact_mean_loss

    return exact_mean_loss(per_token, mask, cp_group)


def add_mtp_loss(loss: torch.Tensor, chunk: nn.Module, batch: dict[str, Any],
                 topo: ParallelTopology, scale: float = 1.0) -> torch.Tensor:
    """``loss`` (the main loss times ``scale``) whose backward also carries
    ``scale * factor / N * sum_k loss_k`` of ``chunk``'s last forward; its value unchanged.
    Records the depths' losses for the log (training forwards only)."""
    mtp = getattr(chunk, "mtp", None)
    if mtp is None or mtp.pending is None:
        return loss
    pending, mtp.pending = mtp.pending, None
    masks = batch["mtp_loss_mask"]
    cp_group = topo.cp_group if topo.cp_size > 1 else None
    per_depth = [_masked_mean(p, masks[..., k], cp_group) for k, p in enumerate(pending)]
    if torch.is_grad_enabled():
        mtp.tracked.append(torch.stack([v.detach().double() for v in per_depth]))
    factor = chunk.config.mtp_loss_scaling_factor / len(per_depth)
    extra = torch.stack(per_depth).sum() * (factor * scale)
    return loss + (extra - extra.detach())


def collect(chunks: list[nn.Module], topo: ParallelTopology, depths: int) -> dict[str, float]:
    """``mtp_k loss`` of the log interval: the mean over its micro-batches and data-parallel
    replicas. Collective over the world (every rank calls it); resets the sums."""
    table = torch.zeros(depths + 1, dtype=torch.float64)
    for c in chunks:
        mtp = getattr(c, "mtp", None)
        if mtp is not None:
            if mtp.tracked and topo.tp_rank == 0 and topo.cp_rank == 0:
                table[:depths] += torch.stack(mtp.tracked).sum(dim=0).cpu()
                table[depths] += len(mtp.tracked)
            mtp.tracked = []
    if dist.is_available() and dist.is_initialized() and topo.world_size > 1:
        device = next(chunks[0].parameters()).device
        on = table.to(device)
        dist.all_reduce(on)
        table = on.cpu()
    if table[-1] == 0:
        return {}
    return {f"mtp_{k + 1} loss": float(table[k] / table[-1]) for k in range(depths)}
