"""Token dispatchers: move each routed token to the rank that holds its expert and back.

``dispatch(x [T, H], probs [T, E], routing_map [T, E]) -> (expert_input [N, H], counts)``
returns the rows the local experts compute, sorted by local expert (``counts[i]`` rows for
local expert ``i``); ``combine(expert_output [N, H]) -> [T, H]`` weights every row by its
routing probability and sums the rows of each token back in place.

- :class:`AllGatherDispatcher` (``--moe-token-dispatcher-type allgather``): every rank of the
  expert-parallel group gathers all the group's tokens, runs its experts on the ones routed to
  them, and a reduce-scatter returns each rank the sum for its own tokens. With one EP rank it
  is the local permutation.
- :class:`AllToAllDispatcher` (``alltoall``): each rank sends only the rows that its peers'
  experts need, through ``all_to_all_single`` with variable split sizes (the per-expert counts
  are all-gathered first so every rank knows what it receives), then sorts the rows it got
  from ``(source rank, local expert)`` into ``(local expert, source rank)`` order.

Under expert tensor parallelism the layer gathers the dispatched rows over the expert tensor
group before its experts run and reduce-scatters their partial outputs before ``combine``
(:mod:`megazero.moe.expert_tp`): the dispatchers work on whole experts' rows either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megazero.combined_1f1b.duet import exchange
from megazero.distributed.collectives import Group, group_rank, group_size
from megazero.tensor_parallel.mappings import (
    all_gather_dim0,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megazero.tensor_parallel.overlap import InFlight, compute


def permute(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
            capacity: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed copies of ``x``'s rows grouped by expert (token order inside an expert):
    ``(rows, row_probs, token_index, counts [E])``. With ``capacity`` every expert gets exactly
    that many rows, padded with zero rows whose ``token_index`` is ``T`` (a discarded slot)."""
    t, e = routing_map.shape
    mask = routing_map.t()  # [E, T]
    token_index = torch.arange(t, device=x.device).expand(e, t).masked_select(mask)
    row_probs = probs.t().masked_select(mask)
    counts = mask.sum(dim=1)
    if capacity is not None:
        pos = torch.arange(capacity, device=x.device).expand(e, capacity)
        slot = pos < counts.unsqueeze(1)
        padded = torch.full((e, capacity), t, dtype=token_index.dtype, device=x.device)
        token_index = padded.masked_scatter(slot, token_index).reshape(-1)
        row_probs = torch.zeros(e, capacity, dtype=row_probs.dtype, device=x.device
                                ).masked_scatter(slot, row_probs).reshape(-1)
        counts = torch.full_like(counts, capacity)
        x = torch.cat([x, x.new_zeros(1, x.shape[-1])])
    return x.index_select(0, token_index), row_probs, token_index, counts


def unpermute(rows: torch.Tensor, row_probs: torch.Tensor, token_index: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """``sum`` over each token's rows of ``prob * row``, as ``[num_tokens, H]``."""
    weighted = rows * row_probs.unsqueeze(1).to(rows.dtype)
    out = rows.new_zeros(num_tokens + 1, rows.shape[-1])
    return out.index_add(0, token_index, weighted)[:num_tokens]


class AllGatherDispatcher:
    """Local experts ``[first, first + local)`` of ``num_experts``; ``ep_group`` None: EP 1."""

    def __init__(self, num_experts: int, first: int, local: int, ep_group: Group = None,
                 capacity: int | None = None):
        self.num_experts, self.first, self.local = num_experts, first, local
        self.ep_group = ep_group
        self.capacity = capacity  # pad every expert's input to this many rows
        self._state: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 under: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[int]]:
        """``under`` (the shared expert) runs first: this dispatcher's all-gathers are
        synchronous, nothing is in flight to hide."""
        if under is not None:
            under()
        x = gather_from_sequence_parallel_region(x, self.ep_group)
        probs = gather_from_sequence_parallel_region(probs, self.ep_group)
        routing_map = all_gather_dim0(routing_map, self.ep_group)
        sl = slice(self.first, self.first + self.local)
        # each source rank holds at most `capacity` rows per expert
        cap = None if self.capacity is None else self.capacity * group_size(self.ep_group)
        rows, row_probs, token_index, counts = permute(
            x, probs[:, sl], routing_map[:, sl], cap)
        self._state = (row_probs, token_index, x.shape[0])
        return rows, counts.tolist()

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        assert self._state is not None, "combine before dispatch"
        row_probs, token_index, t = self._state
        self._state = None
        y = unpermute(out, row_probs, token_index, t)
        return reduce_scatter_to_sequence_parallel_region(y, self.ep_group)


def _send_rows(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int],
               direction: str) -> torch.Tensor:
    """``all_to_all_single`` of ``x``'s rows. Inside a combined 1F1B pair whose other pass
    still runs (:mod:`megazero.combined_1f1b.duet`), that pass computes while the rows travel
    (traced as ``ep_a2a_<direction>``); otherwise the wait follows the start (traced as
    ``ep_all_to_all``)."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    x = x.contiguous()
    exchange(lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group,
                                            async_op=True),
             f"ep_a2a_{direction}", alone="ep_all_to_all")
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits; backward sends the gradients back along
    the same routes (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _send_rows(x, group, out_splits, in_splits, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = _send_rows(grad, ctx.group, ctx.in_splits, ctx.out_splits, "backward")
        return back, None, None, None


class _AllToAllStart(torch.autograd.Function):
    """:class:`_AllToAll` issued asynchronously: the output is valid once ``pending[0]`` (the
    traced work) is waited for; backward as :class:`_AllToAll` (synchronous)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, out_splits: list[int],
                in_splits: list[int], pending: list[InFlight]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        t0 = time.perf_counter()
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                      async_op=True)
        pending.append(InFlight("ep_dispatch", [work], t0))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        back: torch.Tensor = _AllToAll.apply(  # type: ignore[no-untyped-call]
            grad.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits)
        return back, None, None, None, None


def all_to_all_under(x: torch.Tensor, group: Group, out_splits: list[int],
                     in_splits: list[int], under: Callable[[], None]) -> torch.Tensor:
    """:func:`all_to_all` with ``under()`` running while it is in flight (megatron-core's
    ``--moe-shared-expert-overlap``: the shared expert under the dispatch)."""
    pending: list[InFlight] = []
    out: torch.Tensor = _AllToAllStart.apply(  # type: ignore[no-untyped-call]
        x, group, out_splits, in_splits, pending)
    compute(under)
    pending[0].wait()
    return out


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]
               ) -> torch.Tensor:
    out: torch.Tensor = _AllToAll.apply(  # type: ignore[no-untyped-call]
        x, group, out_splits, in_splits)
    return out


def chunk_order(rows_per_chunk: torch.Tensor, block_rows: int | None = None) -> torch.Tensor:
    """Row permutation that turns chunks laid out ``[a][b]`` (``rows_per_chunk`` ``[A, B]``)
    into ``[b][a]`` order. ``block_rows``: each ``a`` starts a block of that many rows (its
    chunks first, padding after), as a padded all-gather lays them out; default: packed."""
    a, b = rows_per_chunk.shape
    within = torch.cumsum(rows_per_chunk, dim=1) - rows_per_chunk
    if block_rows is None:
        block_start = torch.cumsum(rows_per_chunk.sum(dim=1), 0) - rows_per_chunk.sum(dim=1)
    else:
        block_start = torch.arange(a, dtype=rows_per_chunk.dtype) * block_rows
    starts = (within + block_start.unsqueeze(1)).reshape(-1)
    flat = rows_per_chunk.reshape(-1)
    order = torch.arange(a * b).view(a, b).t().reshape(-1)
    return torch.cat([torch.arange(int(starts[i]), int(starts[i] + flat[i])) for i in order]
                     ) if flat.sum() > 0 else torch.zeros(0, dtype=torch.long)


class AllToAllDispatcher:
    """Experts ``[r * local, (r + 1) * local)`` on rank ``r`` of ``ep_group``."""

    def __init__(self, num_experts: int, first: int, local: int, ep_group: Group = None,
                 capacity: int | None = None):
        self.num_experts, self.first, self.local = num_experts, first, local
        self.ep_group = ep_group
        self.capacity = capacity
        self._state: dict[str, Any] = {}

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 under: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[int]]:
        """``under`` (the shared expert) runs while the dispatch all-to-all is in flight."""
        ep = group_size(self.ep_group)
        rows, row_probs, token_index, counts = permute(x, probs, routing_map, self.capacity)
        # counts[r_src, e] for every rank of the group
        all_counts = all_gather_dim0(counts.unsqueeze(0), self.ep_group).cpu()
        me = group_rank(self.ep_group)
        in_splits = counts.cpu().view(ep, self.local).sum(dim=1).tolist()
        mine = all_counts[:, me * self.local:(me + 1) * self.local]  # [ep_src, local]
        out_splits = mine.sum(dim=1).tolist()
        if ep > 1 and under is not None:
            got = all_to_all_under(rows, self.ep_group, out_splits, in_splits, under)
        elif ep > 1:
            got = all_to_all(rows, self.ep_group, out_splits, in_splits)
        else:
            got = rows
            if under is not None:
                under()
        order = chunk_order(mine).to(x.device)
        self._state = dict(row_probs=row_probs, token_index=token_index, t=x.shape[0],
                           order=order, in_splits=in_splits, out_splits=out_splits)
        return got.index_select(0, order), mine.sum(dim=0).tolist()

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        s, self._state = self._state, {}
        back = torch.zeros_like(out).index_add(0, s["order"], out)
        if group_size(self.ep_group) > 1:
            back = all_to_all(back, self.ep_group, s["in_splits"], s["out_splits"])
        return unpermute(back, s["row_probs"], s["token_index"], s["t"])


Dispatcher = AllGatherDispatcher | AllToAllDispatcher
DISPATCHERS: dict[str, type[AllGatherDispatcher] | type[AllToAllDispatcher]] = {
    "allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}
