"""The tied word embedding across pipeline stages.

With pp > 1 and tied input / output embeddings, the first stage holds the word embedding and the
last stage a copy for the output layer; both are flagged ``shared_embedding``. Their gradients
are summed over the embedding group by the gradient sync
(:class:`megazero.pipeline.grad_sync.GradSync`, ``finish_grad_sync()`` of
:class:`megazero.zero.ZeroOptimizer`), after the schedule: the first stage finishes its backwards
long after the last stage, so a collective between them in mid-schedule would deadlock. This module
keeps the two copies' values equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megazero.distributed.topology import ParallelTopology


def shared_embedding_params(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Params marked ``shared_embedding``: the word embedding and the last stage's copy."""
    return [p for c in model_chunks for p in c.parameters()
            if getattr(p, "shared_embedding", False)]


@torch.no_grad()
def sync_tied_embeddings(model_chunks: Sequence[torch.nn.Module], topo: ParallelTopology) -> None:
    """Make the last stage's copy of the word embedding equal to the first stage's.

    The model initialises both copies identically from the seed; this broadcast makes that a
    guarantee (e.g. after loading a checkpoint written with another layout).
    """
    if topo.pp_size == 1 or not topo.in_embedding_group:
        return
    params = shared_embedding_params(model_chunks)
    if len(params) == 2:  # the V (ZBV, DualPipeV): both copies on this rank, chunk 0's first
        with torch.no_grad():
            params[1].data.copy_(params[0].data)
        return
    c = topo.coord
    src = topo.layout.rank(0, c.dp, c.tp, topo.cp_rank)
    for p in params:
        dist.broadcast(p.data, src=src, group=topo.embedding_group)
