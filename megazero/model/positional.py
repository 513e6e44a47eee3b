"""Rotary position embeddings (RoPE), Megatron/GPT-NeoX "rotate half" convention.

With ``--rotary-percent p`` (GPT-NeoX's ``rotary_pct``) the tables cover the first
``head_dim * p`` dims of each head; :func:`apply_rotary` rotates those and passes the rest."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos``/``sin`` tables ``[max_positions, 1, 1, head_dim]`` (non-persistent
    buffers: derived from ``base``, not state to checkpoint)."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[s, b, heads, head_dim]`` by position (its first
    ``cos.shape[-1]`` dims when the tables are narrower than the head)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head, rest = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + _rotate_half(head) * sin, rest], dim=-1)
