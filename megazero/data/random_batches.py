"""Deterministic random language-model micro-batches: the planner's measurement runs
(``megazero.testing.planner_validate``) and tests drive the model with them."""

from __future__ import annotations

import torch


def random_lm_batches(num_microbatches: int, vocab_size: int, micro_batch_size: int,
                      seq_length: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``num_microbatches`` dicts of ``tokens [b, s]`` and ``labels`` (tokens shifted left by
    one, wrapping), drawn from a generator seeded with ``seed`` so every rank can rebuild them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=g)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)})
    return out
