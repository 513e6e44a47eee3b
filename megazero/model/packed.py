"""Packed documents kept apart (Megatron's ``--reset-position-ids`` / ``--reset-attention-mask``).

A pretraining sequence holds several documents, each ended by the end-of-document token.
Megatron's rule (``get_ltor_masks_and_position_ids``): the end-of-document token belongs to the
document it ends; the token after it starts the next one, whose positions restart at 0
(``--reset-position-ids``) and whose tokens attend only to tokens of their own document
(``--reset-attention-mask``). Then every document of a packed sequence gets exactly the
per-token loss it would get alone.

The batch carries ``document_ids [b, s]`` (how many documents ended before each token) and
``doc_position_ids [b, s]``, computed on the whole sequence before any context-parallel split.
Attention masks ``key <= query`` (by global position) and ``same document``: on CUDA in
fp16/bf16 with flash-attn installed (and no context parallelism), flash-attn's variable-length
kernel over the documents as separate sequences; elsewhere SDPA with a boolean mask (every
query sees itself, so no row is empty). Under context parallelism the keys and
values of the whole sequence are all-gathered over the CP group whatever ``--cp-comm-type``
says (their gradients reduce-scattered back), with the document ids and global positions of
every share, so documents cut by the zigzag split are handled exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.mappings import gather_from_sequence_parallel_region

try:  # optional dependency
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None


def _flash_varlen_usable(x: torch.Tensor) -> bool:
    return (flash_attn_varlen_func is not None and x.is_cuda
            and x.dtype in (torch.float16, torch.bfloat16))


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, s]``: the number of end-of-document tokens strictly before each token."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: each token's position inside its document."""
    s = docs.shape[1]
    idx = torch.arange(s, device=docs.device).expand_as(docs)
    new = torch.ones_like(docs, dtype=torch.bool)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=1).values
    return idx - start


def packed_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor,
                k_pos: torch.Tensor) -> torch.Tensor:
    """``[b, 1, sq, sk]`` True where query may attend the key: causal by global position,
    same document."""
    causal = k_pos[None, :] <= q_pos[:, None]
    return ((q_docs[:, :, None] == k_docs[:, None, :]) & causal).unsqueeze(1)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor,
                     parallel: ParallelContext) -> torch.Tensor:
    """``[s, b, heads, d]`` q and ``[s, b, groups, d]`` k, v of this rank (its CP share) ->
    ``[s, b, heads * d]``; ``docs [b, s]`` the local tokens' document ids."""
    s, b, n, d = q.shape
    if (parallel.cp_size == 1 and parallel.attention_backend in ("auto", "flash")
            and _flash_varlen_usable(q)):
        return _flash_varlen(q, k, v, docs)
    q_pos = torch.arange(s, device=q.device)
    k_pos, k_docs = q_pos, docs
    if parallel.cp_size > 1:
        from megazero.context_parallel.split import local_positions

        cp, group = parallel.cp_size, parallel.cp_group
        seq = s * cp
        k = gather_from_sequence_parallel_region(k, group)  # rank order; backward sums dK
        v = gather_from_sequence_parallel_region(v, group)
        shares = [torch.empty_like(docs) for _ in range(cp)]
        dist.all_gather(shares, docs.contiguous(), group=group)
        k_docs = torch.cat(shares, dim=1)
        k_pos = torch.cat([local_positions(seq, r, cp, q.device) for r in range(cp)])
        q_pos = local_positions(seq, parallel.cp_rank, cp, q.device)
    mask = packed_mask(docs, k_docs, q_pos, k_pos)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    if kb.shape[1] != n:  # grouped-query attention
        kb = kb.repeat_interleave(n // kb.shape[1], dim=1)
        vb = vb.repeat_interleave(n // vb.shape[1], dim=1)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def document_starts(docs: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int32) of the documents of ``docs [b, s]`` laid end to end, batch-major:
    a document starts where the id changes or a row begins."""
    b, s = docs.shape
    new = torch.ones(b, s, dtype=torch.bool, device=docs.device)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    starts = new.reshape(-1).nonzero().flatten()
    end = torch.tensor([b * s], device=docs.device)
    return torch.cat([starts, end]).to(torch.int32)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor
                  ) -> torch.Tensor:
    """Each document its own causal sequence in flash-attn's variable-length kernel."""
    assert flash_attn_varlen_func is not None
    s, b, n, d = q.shape
    cu = document_starts(docs)
    longest = int((cu[1:] - cu[:-1]).max())  # one host sync a layer
    qf, kf, vf = (t.transpose(0, 1).reshape(b * s, t.shape[2], t.shape[3]) for t in (q, k, v))
    extra = {"deterministic": True} if torch.are_deterministic_algorithms_enabled() else {}
    out = flash_attn_varlen_func(qf, kf, vf, cu, cu, longest, longest, causal=True, **extra)
    return out.reshape(b, s, n * d).transpose(0, 1)
