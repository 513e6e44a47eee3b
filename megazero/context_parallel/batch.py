"""This context-parallel rank's share of a micro-batch: every ``[b, s]`` tensor split along the
sequence into the zigzag chunks the rank holds (tokens, labels, loss mask, position ids). The
model takes its positions (learned embeddings, rotary rows) from the same split, so the share
alone is enough to run it."""

from __future__ import annotations

import torch

from megazero.context_parallel.split import local_positions, split

#: Batch entries indexed by sequence position (dim 1).
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask",
                 "mtp_loss_mask", "doc_position_ids", "document_ids")


def split_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int
                ) -> dict[str, torch.Tensor]:
    """``batch`` with its ``[b, s]`` entries cut to this rank's ``[b, s / cp]`` share, and
    ``position_ids`` (the global positions held) added when it has none."""
    if cp_size == 1:
        return batch
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in out:
            out[key] = split(out[key], 1, cp_rank, cp_size)
    if "position_ids" not in batch and "tokens" in batch:
        seq = batch["tokens"].shape[1]
        pos = local_positions(seq, cp_rank, cp_size, batch["tokens"].device)
        out["position_ids"] = pos.unsqueeze(0).expand(batch["tokens"].shape[0], -1)
    return out
