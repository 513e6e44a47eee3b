"""Which fusions a run uses, for the start-up banner (and the GPU benchmark reading it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megazero.fusions.compiled import triton_available

if TYPE_CHECKING:
    from megazero.config import ModelConfig


def active_fusions(m: ModelConfig, device: torch.device) -> list[str]:
    """The fused operations a training step of model ``m`` on ``device`` runs, by Megatron's
    names. The bias-dropout-add counts only where there is a bias and no hidden dropout (with
    dropout the mask is drawn eagerly and the add is unfused; see :mod:`megazero.fusions`)."""
    if device.type != "cuda" and not m.fusions_on_cpu:
        return []
    if device.type == "cuda" and not triton_available():
        return []
    dropout_add = m.bias_dropout_fusion and m.add_bias_linear and m.hidden_dropout == 0
    candidates = (("bias-gelu", m.bias_gelu_fusion and not m.swiglu),
                  ("bias-swiglu", m.bias_swiglu_fusion and m.swiglu),
                  ("bias-dropout-add", dropout_add),
                  ("rope", m.apply_rope_fusion and m.position_embedding_type == "rope"))
    return [name for name, on in candidates if on]


def describe_fusions(m: ModelConfig, device: torch.device) -> str:
    names = active_fusions(m, device)
    if names:
        return ", ".join(names) + " (torch.compile)"
    if device.type != "cuda" and not m.fusions_on_cpu:
        return "none (eager on CPU; --fusions-on-cpu compiles them)"
    if device.type == "cuda" and not triton_available():
        return "none (Triton is not installed: torch.compile cannot build the GPU kernels)"
    return "none"
