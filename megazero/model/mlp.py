"""The feed-forward block: column-parallel fc1, GELU or SwiGLU, row-parallel fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig
from megazero.fusions import bias_gelu, bias_swiglu, use_fusion
from megazero.model.init import declare_linear, scope
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.layers import (
    DEFERRED_INIT,
    ColumnParallelLinear,
    RowParallelLinear,
)

_NO_INIT = DEFERRED_INIT  # real values come from megazero.model.init


class MLP(nn.Module):
    """With SwiGLU, fc1 produces ``[gate; up]`` (full layout, 2*ffn rows); each TP rank holds
    its slice of both halves (``partition_stride = 2``), so the gating is rank-local."""

    def __init__(self, config: ModelConfig, *, parallel: ParallelContext | None = None):
        super().__init__()
        self.swiglu = config.swiglu
        # GPT-2 was trained with the tanh approximation; checkpoints imported from it need it.
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        ffn = config.ffn_size
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if self.swiglu else ffn, parallel=parallel,
            bias=config.add_bias_linear, partition_stride=2 if self.swiglu else 1,
            init_method=_NO_INIT)
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, parallel=parallel, bias=config.add_bias_linear,
            init_method=_NO_INIT)
        scope(declare_linear(self.linear_fc1), "linear_fc1")
        scope(declare_linear(self.linear_fc2, depth_scaled=True), "linear_fc2")
        self.fuse_activation = config.bias_swiglu_fusion if self.swiglu else \
            config.bias_gelu_fusion
        self.fusions_on_cpu = config.fusions_on_cpu

    def _fused_activation(self, x: torch.Tensor) -> torch.Tensor:
        """fc1's product without its bias, then bias + activation in one compiled kernel
        (:mod:`megazero.fusions`), as fc1's epilogue (inside its forward: see
        :meth:`ColumnParallelLinear.forward`)."""
        if self.swiglu:
            return self.linear_fc1(x, epilogue=bias_swiglu)
        approximate = self.gelu_approximate
        return self.linear_fc1(x, epilogue=lambda h, b: bias_gelu(h, b, approximate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fusion(self.fuse_activation, x, self.fusions_on_cpu):
            return self.linear_fc2(self._fused_activation(x))
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)
