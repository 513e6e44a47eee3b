"""The load-balanced split of a sequence over the context-parallel group.

Causal attention makes late tokens cost more than early ones (token ``i`` attends to ``i + 1``
keys). Cutting the sequence into ``2·CP`` equal chunks and giving CP rank ``r`` chunks ``r`` and
``2·CP-1-r`` (Megatron-core's "zigzag" / torchtitan's head-tail balancer) gives every rank the
same number of query-key pairs. Everything indexed by sequence position is split the same way:
tokens, labels, loss mask, position ids, rotary tables, learned position embeddings.

Within a rank the two chunks are kept in increasing position order, so ordinary causal masking
of the local sequence is correct for the local queries against the local keys.
"""

from __future__ import annotations

import torch


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2·cp_size``) that ``cp_rank`` holds, in order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_divisible(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel "
                         f"size ({2 * cp_size}); pick a --seq-length that is")


def local_positions(seq_len: int, cp_rank: int, cp_size: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (``[seq_len / cp_size]``, int64) of the tokens ``cp_rank`` holds."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    check_divisible(seq_len, cp_size)
    c = seq_len // (2 * cp_size)
    a, b = chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def split(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """``cp_rank``'s share of ``x`` along sequence dimension ``dim`` (a contiguous copy)."""
    if cp_size == 1:
        return x
    check_divisible(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unsplit(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`split`: the whole sequence from every rank's share, in rank order."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunk_ids(r, cp_size)
        chunks[a], chunks[b] = first, second
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def zigzag_order(seq_len: int, cp_size: int) -> torch.Tensor:
    """Positions of the concatenation of every rank's share in rank order (rank 0's tokens,
    then rank 1's, ...): ``full[zigzag_order] == cat(shares)``. Its argsort undoes it."""
    return torch.cat([local_positions(seq_len, r, cp_size) for r in range(cp_size)])
