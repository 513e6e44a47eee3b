"""Shared experts: a dense MLP every token passes through beside the routed experts
(``--moe-shared-expert-intermediate-size``), optionally scaled per token by
``sigmoid(x g^T)`` (``--moe-shared-expert-gate``, Qwen-MoE's shared-expert gate).

It is the dense :class:`~megazero.model.mlp.MLP` at the shared width: tensor-parallel over the
TP group like the dense MLP, its gradients reduced like dense weights."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.model.init import declare
from megazero.model.mlp import MLP
from megazero.tensor_parallel.context import ParallelContext


class SharedExpertMLP(nn.Module):
    def __init__(self, config: ModelConfig, *, parallel: ParallelContext | None = None):
        super().__init__()
        size = config.moe.moe_shared_expert_intermediate_size
        assert size is not None
        self.mlp = MLP(replace(config, ffn_hidden_size=size), parallel=parallel)
        # init keys: the dense MLP's (linear_fc1/linear_fc2) directly under shared_experts
        self.gate_weight: nn.Parameter | None = None
        if config.moe.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size))
            self.gate_weight.sequence_parallel = bool(  # type: ignore[attr-defined]
                parallel is not None and parallel.sequence_parallel)
            declare(self.gate_weight, "normal", key="gate_weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))
        return out
