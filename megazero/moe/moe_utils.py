"""The arithmetic of routing, as plain functions on tensors (no modules, no process groups):
top-k scoring, capacity and token dropping, the load-balancing and z losses, and the autograd
hook that adds an auxiliary loss's gradient without touching the main loss.

Shapes: ``logits`` / ``probs`` / ``routing_map`` are ``[T, E]`` for ``T`` tokens and ``E``
experts; ``probs`` is dense with zeros outside each token's chosen experts, ``routing_map`` the
matching boolean mask.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, scaling_factor: float | None = None,
                 expert_bias: torch.Tensor | None = None, num_groups: int | None = None,
                 group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` as megatron-core's ``topk_softmax_with_capacity`` computes them
    before any capacity is applied.

    With ``num_groups`` the experts are split into that many equal groups (nodes) and each
    token chooses only among the experts of its ``group_topk`` best groups
    (:func:`group_limited_topk`).

    softmax: the top-k logits, then a softmax over those k (``pre_softmax``: a softmax over all
    E, then the top k of it). sigmoid: experts chosen by the top k of ``sigmoid(l) + bias``,
    weighted by their unbiased sigmoid scores normalised to sum 1 (for k > 1). Finally the
    weights are multiplied by ``scaling_factor``.
    """
    ft = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=ft)
            weights, idx = _topk(scores, topk, num_groups, group_topk)
        else:
            top, idx = _topk(logits, topk, num_groups, group_topk)
            weights = torch.softmax(top, dim=-1, dtype=ft)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(ft))
        if expert_bias is not None:
            _, idx = _topk(scores + expert_bias, topk, num_groups, group_topk)
            weights = torch.gather(scores, 1, idx)
        else:
            weights, idx = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score function {score_function!r}: expected softmax or sigmoid")
    if scaling_factor is not None:
        weights = weights * scaling_factor
    # fp64 routing (--moe-router-dtype fp64) chooses in double; the weights leave as fp32
    probs = torch.zeros_like(logits, dtype=torch.float32).scatter(1, idx, weights.float())
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``topk`` of ``scores [T, E]`` taken only from each token's ``group_topk`` best
    expert groups: DeepSeek-V3's node-limited routing, which bounds how many nodes a token's
    experts sit on (and so its all-to-all traffic). A group's score is the sum of its two
    highest expert scores (DeepSeek-V3's rule; the one score when a group has one expert),
    so one strong expert does not carry a weak group. Returns ``(values, indices)``."""
    t, e = scores.shape
    per_group = e // num_groups
    grouped = scores.view(t, num_groups, per_group)
    group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, G]
    best = torch.topk(group_scores, group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    masked = scores.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    return torch.topk(masked, topk, dim=-1)


def _topk(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if num_groups is None or num_groups <= 1:
        return torch.topk(scores, topk, dim=-1)
    assert group_topk is not None
    return group_limited_topk(scores, topk, num_groups, group_topk)


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The full ``[T, E]`` scores the balancing loss weighs: the softmax over all E, or the
    sigmoid scores normalised per token (megatron-core's
    ``compute_routing_scores_for_aux_loss``)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    s = torch.sigmoid(logits.float())
    return s / (s.sum(dim=-1, keepdim=True) + 1e-20)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Megatron's ``ceil(k * T / E * factor)`` (T: the tokens routed together)."""
    return math.ceil(topk * num_tokens / num_experts * factor)


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                   policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert: those with the highest weight
    (``probs``) or the first ones in token order (``position``). Returns the masked
    ``(probs, routing_map)``."""
    num_tokens = routing_map.shape[0]
    if capacity >= num_tokens:
        return probs, routing_map
    if policy == "probs":
        key = probs.detach().masked_fill(~routing_map, -1.0)
    elif policy == "position":
        order = torch.arange(num_tokens, 0, -1, device=probs.device, dtype=torch.float32)
        key = order.unsqueeze(1).expand_as(probs).masked_fill(~routing_map, -1.0)
    else:
        raise ValueError(f"drop policy {policy!r}: expected probs or position")
    # stable sort keeps the earlier token on equal weights, on every layout alike
    keep_idx = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
    keep = torch.zeros_like(routing_map).scatter(0, keep_idx, True) & routing_map
    return probs * keep, keep


def zigzag_token_rows(seq_len: int, batch: int, cp_size: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Where each row of the CP ranks' ``[s/cp * b]`` token shares, concatenated in CP rank
    order, sits in the whole micro-batch's ``[s * b]`` rows (row = position * b + sequence).
    The shares are the zigzag chunks (:mod:`megazero.context_parallel.split`), so the
    concatenation is not in sequence order; ``whole[rows] == cat(shares)``."""
    from megazero.context_parallel.split import local_positions

    positions = torch.cat([local_positions(seq_len, r, cp_size, device)
                           for r in range(cp_size)])
    return (positions[:, None] * batch + torch.arange(batch, device=device)).reshape(-1)


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                               topk: int, num_tokens: int) -> torch.Tensor:
    """``E / (k T^2) * sum_i (sum_x s_xi) c_i``: 1.0 when routing is perfectly balanced.
    ``scores`` may be a shard of the ``T`` tokens (the sum over shards is the whole loss);
    ``tokens_per_expert`` (``c``) counts all ``T``."""
    e = scores.shape[-1]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (e / (topk * num_tokens * num_tokens))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, ``mean_x logsumexp(l_x)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also sends gradient ``scale`` into ``aux_loss``.

    An auxiliary loss computed inside a layer reaches the optimizer without being added to
    the main loss (which, under pipeline parallelism, lives on another stage): the layer's
    output carries it. ``scale`` is what the main loss is multiplied by before backward (loss
    scale / micro-batches), set by the training loop through :attr:`main_loss_scale`.
    """

    main_loss_scale: float = 1.0

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, AuxLossScaler.main_loss_scale)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged, with ``aux_loss``'s gradient flowing when it is backpropagated."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output
    out: torch.Tensor = AuxLossScaler.apply(output, aux_loss)  # type: ignore[no-untyped-call]
    return out


def set_aux_loss_scale(scale: float) -> None:
    """The factor the training loop applies to each micro-batch's loss before backward."""
    AuxLossScaler.main_loss_scale = float(scale)
