"""The top-k router: fp32 logits ``x W^T``, top-k scores, capacity, balancing losses and the
aux-loss-free expert bias (megatron-core's ``TopKRouter``).

Everything that depends on "how many tokens" counts the tokens of the whole micro-batch of one
data-parallel replica: with sequence parallelism a TP rank holds a slice of them, so the
expert counts and score sums are summed over ``sum_group`` (the TP group) before the capacity
and the losses are computed. Capacity and dropping are therefore the same at every TP/EP
layout (Megatron counts per rank).

With context parallelism ``sum_group`` is the TP x CP group: each CP rank holds two of the
``2·CP`` zigzag chunks of every sequence, so the group's tokens are the micro-batch in another
order. Dropping puts them back in sequence order first (the ``position`` policy, and the ties
of ``probs``, depend on it). The auxiliary losses' gradients are multiplied by ``cp_size``: CP
ranks' gradients are averaged over the ``dp_cp`` group like the main loss's, which each CP rank
back-propagates ``CP`` times (:mod:`megazero.context_parallel.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.distributed.collectives import Group, group_size
from megazero.distributed.topology import ParallelTopology
from megazero.model.init import declare
from megazero.moe import moe_utils as mu


@dataclass
class RouterStats:
    """What one forward of the router measured, for the log (detached)."""

    load_balancing_loss: torch.Tensor  # unscaled switch loss: 1.0 at balance
    z_loss: torch.Tensor  # unscaled
    tokens_per_expert: torch.Tensor  # after dropping, whole micro-batch
    dropped_fraction: torch.Tensor


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum whose backward is the identity: each rank's share of a sum over the
    group's tokens keeps its own gradient (the loss is counted once per group)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TopKRouter(nn.Module):
    """``forward(x [T, H]) -> (probs [T, E], routing_map [T, E])``. Losses enter the
    backward through :func:`megazero.moe.moe_utils.attach_aux_loss` applied by the layer to
    its output (:meth:`attach_losses`)."""

    local_tokens_per_expert: torch.Tensor  # buffers (registered in __init__)
    metrics_acc: torch.Tensor

    def __init__(self, config: ModelConfig, *, sum_group: Group = None,
                 sequence_parallel: bool = False, cp_size: int = 1):
        super().__init__()
        moe = config.moe
        assert moe.num_experts is not None
        self.moe: MoEConfig = moe
        self.num_experts = moe.num_experts
        self.topk = moe.moe_router_topk
        self.sum_group = sum_group
        self.cp_size = cp_size  # the zigzag split of the sum group's tokens (module docstring)
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size,
                                               dtype=torch.float32))
        self.weight.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        declare(self.weight, "normal", key="weight")
        self.expert_bias: nn.Parameter | None = None
        if moe.moe_router_enable_expert_bias:
            # Not trained by the optimizer (updated from the counts), but a parameter so that
            # checkpoints save and load it with the weights, by its global name; fp32 always.
            self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32),
                                            requires_grad=False)
            self.expert_bias.keep_fp32 = True  # type: ignore[attr-defined]
            declare(self.expert_bias, "zeros", key="expert_bias")
            # counts of the current step (non-persistent: summed over micro-batches)
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(moe.num_experts, dtype=torch.float32),
                                 persistent=False)
        self.layer_number = 0  # global layer index (set by the MoE layer), for the log
        # the log interval's sums: balancing loss, z-loss, micro-batches, routed tokens, then
        # the tokens each expert took (megazero.moe.metrics)
        self.register_buffer("metrics_acc", torch.zeros(4 + moe.num_experts,
                                                        dtype=torch.float64), persistent=False)
        self.stats: RouterStats | None = None
        self._pending: torch.Tensor | None = None

    def materialize_buffers(self, device: torch.device) -> None:
        """Create the expert-bias buffers on ``device`` for a router built on the meta
        device (both start at zero)."""
        for name in ("local_tokens_per_expert", "metrics_acc"):
            buf = getattr(self, name, None)
            if buf is not None and buf.is_meta:
                setattr(self, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
        bias = self.expert_bias
        if bias is not None and bias.is_meta:  # ZeRO-3 materialises only trainable weights
            new = nn.Parameter(torch.zeros(bias.shape, dtype=torch.float32, device=device),
                               requires_grad=False)
            new.__dict__.update(bias.__dict__)  # init rule, keep_fp32
            self.expert_bias = new

    def _group_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.sum_group is None or group_size(self.sum_group) == 1:
            return x
        out: torch.Tensor = _SumOverGroup.apply(x, self.sum_group)  # type: ignore[no-untyped-call]
        return out

    def forward(self, x: torch.Tensor, seq_batch: tuple[int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``[T, H]`` tokens of this rank; ``seq_batch``: the ``(s, b)`` shape the
        local tokens came from (``seq_aux_loss`` needs the sequences)."""
        moe = self.moe
        # fp32 logits whatever the training dtype (the weight is cast with the model)
        # (--moe-router-dtype fp64 computes them, and the routing, in double precision)
        dtype = torch.float64 if moe.moe_router_dtype == "fp64" else torch.float32
        logits = torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))
        bias = self.expert_bias
        probs, routing_map = mu.topk_routing(
            logits, self.topk, score_function=moe.moe_router_score_function,
            pre_softmax=moe.moe_router_pre_softmax,
            scaling_factor=moe.moe_router_topk_scaling_factor,
            expert_bias=None if bias is None else bias.to(dtype),
            num_groups=moe.moe_router_num_groups, group_topk=moe.moe_router_group_topk)
        # sequence parallelism splits the micro-batch into equal slices
        total_tokens = x.shape[0] * (1 if self.sum_group is None else group_size(self.sum_group))
        counts_before = self._group_sum(routing_map.sum(dim=0).float())
        if moe.moe_expert_capacity_factor is not None:
            cap = mu.expert_capacity(total_tokens, self.num_experts, self.topk,
                                     moe.moe_expert_capacity_factor)
            probs, routing_map = self._capacity(probs, routing_map, cap, seq_batch)
        counts = self._group_sum(routing_map.sum(dim=0).float())
        aux = self._balancing_loss(logits, counts_before, total_tokens, seq_batch)
        zl = mu.z_loss(logits) if moe.moe_z_loss_coeff is not None else logits.new_zeros(())
        pending = logits.new_zeros(())
        if moe.moe_aux_loss_coeff > 0 and aux.requires_grad:
            pending = pending + moe.moe_aux_loss_coeff * aux
        if moe.moe_z_loss_coeff is not None and zl.requires_grad:
            tp = 1 if self.sum_group is None else group_size(self.sum_group)
            pending = pending + moe.moe_z_loss_coeff / tp * zl
        if self.cp_size > 1:  # averaged over CP like the main loss (module docstring)
            pending = pending * self.cp_size
        self._pending = pending if pending.requires_grad else None
        if self.expert_bias is not None and torch.is_grad_enabled():
            self.local_tokens_per_expert += routing_map.sum(dim=0).float().detach()
        dropped = 1.0 - counts.sum() / (counts_before.sum().clamp(min=1.0))
        zl_total = self._group_sum(zl.detach() * x.shape[0]) / total_tokens
        self.stats = RouterStats(aux.detach(), zl_total, counts.detach(), dropped.detach())
        if torch.is_grad_enabled():  # training forwards (a recomputed one runs once with grad)
            self.metrics_acc += torch.cat([
                torch.stack([aux.detach(), zl_total, torch.ones_like(zl_total),
                             counts_before.sum()]).to(torch.float64),
                counts.detach().to(torch.float64)])
        return probs, routing_map

    def _capacity(self, probs: torch.Tensor, routing_map: torch.Tensor, cap: int,
                  seq_batch: tuple[int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop over the whole micro-batch: with a sum group the group's tokens are gathered
        (all ranks then choose the same tokens) and each rank keeps its own rows; with CP
        they are chosen in sequence order, as the one-rank run sees them."""
        if self.sum_group is None or group_size(self.sum_group) == 1:
            return mu.apply_capacity(probs, routing_map, cap, self.moe.moe_token_drop_policy)
        size = group_size(self.sum_group)
        parts = [torch.empty_like(probs) for _ in range(size)]
        dist.all_gather(parts, probs.detach().contiguous(), group=self.sum_group)
        maps = [torch.empty_like(routing_map) for _ in range(size)]
        dist.all_gather(maps, routing_map.contiguous(), group=self.sum_group)
        every, every_map = torch.cat(parts), torch.cat(maps)
        rows = None
        if self.cp_size > 1:
            assert seq_batch is not None, "dropping under CP needs the (seq, batch) shape"
            rows = mu.zigzag_token_rows(seq_batch[0] * size, seq_batch[1], self.cp_size,
                                        every.device)
            in_order = torch.argsort(rows)  # gathered rows in sequence order
            every, every_map = every[in_order], every_map[in_order]
        _, keep = mu.apply_capacity(every, every_map, cap, self.moe.moe_token_drop_policy)
        if rows is not None:
            keep = keep[rows]
        rank = dist.get_rank(self.sum_group)
        n = probs.shape[0]
        mine = keep[rank * n:(rank + 1) * n]
        return probs * mine, mine

    def _balancing_loss(self, logits: torch.Tensor, counts: torch.Tensor, total: int,
                        seq_batch: tuple[int, int] | None) -> torch.Tensor:
        kind = self.moe.moe_router_load_balancing_type
        if kind == "none":
            return logits.new_zeros(())
        scores = mu.scores_for_aux_loss(logits, self.moe.moe_router_score_function)
        if kind == "aux_loss":
            return mu.switch_load_balancing_loss(self._group_sum(scores.sum(dim=0))[None],
                                                 counts, self.topk, total)
        # seq_aux_loss: one switch loss per sequence, averaged over the batch
        assert seq_batch is not None, "seq_aux_loss needs the (seq, batch) shape"
        s_local, b = seq_batch
        s = total // b
        e = self.num_experts
        per_seq_scores = self._group_sum(scores.view(s_local, b, e).sum(dim=0))  # [b, E]
        # the routing map before dropping, per sequence, counted over the group
        _, rmap = mu.topk_routing(logits.detach(), self.topk,
                                  score_function=self.moe.moe_router_score_function,
                                  pre_softmax=self.moe.moe_router_pre_softmax,
                                  expert_bias=self.expert_bias,
                                  num_groups=self.moe.moe_router_num_groups,
                                  group_topk=self.moe.moe_router_group_topk)
        per_seq_counts = self._group_sum(rmap.view(s_local, b, e).sum(dim=0).float())
        loss = (per_seq_scores * per_seq_counts).sum() * (e / (self.topk * s * s))
        return loss / b

    def attach_losses(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` carrying the gradient of this forward's auxiliary losses."""
        pending, self._pending = self._pending, None
        return output if pending is None else mu.attach_aux_loss(output, pending)

    @torch.no_grad()
    def update_expert_bias(self, group: Group = None) -> None:
        """``b += rate * sign(mean(c) - c)`` from the counts of the whole step (summed over
        ``group``: every rank that routed tokens of this step), then reset the counts."""
        if self.expert_bias is None:
            return
        counts = self.local_tokens_per_expert
        if group is not None and group_size(group) > 1:
            dist.all_reduce(counts, group=group)
        self.expert_bias.add_(self.moe.moe_router_bias_update_rate * torch.sign(
            counts.mean() - counts))
        counts.zero_()


def routers(chunks: list[nn.Module]) -> list[TopKRouter]:
    """Every router of this rank's model chunks, in layer order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


@torch.no_grad()
def update_expert_biases(chunks: list[nn.Module], topo: ParallelTopology, apply: bool = True
                         ) -> None:
    """End of a training step: each router's expert bias moves by the token counts of the
    whole step, summed over every rank of its pipeline stage (the ``etp``, ``ep`` and ``edp``
    groups together cover the stage: each rank's own tokens counted once).
    ``apply`` False (a skipped step) only resets the counts."""
    for r in routers(chunks):
        if r.expert_bias is None:
            continue
        if not apply:
            r.local_tokens_per_expert.zero_()
            continue
        counts = r.local_tokens_per_expert
        for group in (topo.etp_group, topo.ep_group, topo.edp_group):
            if group is not None and group_size(group) > 1:
                dist.all_reduce(counts, group=group)
        r.update_expert_bias(None)
