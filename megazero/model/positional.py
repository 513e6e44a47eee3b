"""Rotary position embeddings (RoPE), Megatron/GPT-NeoX "rotate half" convention.

With ``--rotary-percent p`` (GPT-NeoX's ``rotary_pct``) the tables cover the first
``head_dim * p`` dims of each head; :func:`apply_rotary` rotates those and passes the rest."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, ``0.1 * mscale * ln(factor) + 1`` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN's context extension (``--rotary-scaling-factor``, ``--mscale``,
    ``--mscale-all-dim``, ``--original-max-position-embeddings``; DeepSeek-V3's
    ``rope_scaling``): frequencies that turn fewer than ``beta_slow`` times over the original
    length are interpolated by ``factor``, those turning more than ``beta_fast`` times kept,
    a linear ramp between; the tables are scaled by ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)``."""

    factor: float
    original_max_positions: int
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self, dim: int, base: float) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_positions / (rotations * 2 * math.pi))
                    / (2 * math.log(base)))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        interpolated = extrapolated / self.factor
        keep = 1 - ramp  # 1: the high frequencies, kept as trained
        return interpolated * (1 - keep) + extrapolated * keep

    @property
    def attention_factor(self) -> float:
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                   self.mscale_all_dim)


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos``/``sin`` tables ``[max_positions, 1, 1, head_dim]`` (non-persistent
    buffers: derived from ``base``, not state to checkpoint); with ``yarn``, YaRN's
    frequencies and table scale."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0,
                 yarn: YaRN | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
        if yarn is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                       / head_dim))
            scale = 1.0
        else:
            inv_freq, scale = yarn.inv_freq(head_dim, base), yarn.attention_factor
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        self.register_buffer("cos", (emb.cos() * scale).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).float(), persistent=False)

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
