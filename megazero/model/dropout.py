"""Dropout that always saves a 1-byte mask for backward."""

from __future__ import annotations

import torch


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout`` equivalent built on ``torch.native_dropout``.

    On CUDA ``F.dropout`` already uses the fused kernel, which keeps a bool mask for backward.
    On CPU it instead multiplies by a scaled noise tensor of the input's dtype and saves that
    (2 bytes per element in bf16, 4 in fp32). ``native_dropout`` saves the bool mask on every
    device, so activation memory matches Megatron's accounting (1 byte per dropped element)
    everywhere. Randomness comes from the global generator, i.e. from the RNG tracker stream
    forked by the caller.
    """
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]
