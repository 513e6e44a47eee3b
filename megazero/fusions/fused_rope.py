"""Rotary embedding of queries and keys (Megatron's ``--apply-rope-fusion``): both rotations
in one compiled graph instead of the eager chunk, negate, cat, two multiplies and an add each.

The formula is :func:`megazero.model.positional.apply_rotary`'s ("rotate half", partial rotary
passing the rest of each head through), written here again because this package sits below the
model in the import graph; the tests hold the two equal."""

from __future__ import annotations

import torch

from megazero.fusions.compiled import fuse


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    head = x[..., :rot]
    x1, x2 = head.chunk(2, dim=-1)
    out = head * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def rope_qk_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` (``[s, b, heads or groups, d]``) rotated by position with the tables
    ``cos``/``sin`` (``[s, 1, 1, rotary dims]``)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


rope_qk = fuse(rope_qk_eager)
