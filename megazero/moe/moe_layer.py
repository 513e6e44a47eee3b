"""The MoE block that replaces a layer's MLP: router, dispatcher, local experts and optional
shared experts (megatron-core's ``MoELayer``).

``y = sum_{e in top-k(x)} p_e FFN_e(x) + shared(x)``, on ``[s(/t), b, h]`` activations as the
dense MLP takes them. Under sequence parallelism each TP rank routes its own slice of tokens
(the router sums counts and scores over the TP group so capacity and the balancing loss see
the whole micro-batch); experts are split over the expert-parallel group, and each expert
over the expert-tensor-parallel group (:mod:`megazero.moe.expert_tp`).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.errors import ConfigError
from megazero.model.init import scope
from megazero.moe.expert_tp import ExpertTensorParallelRegion
from megazero.moe.experts import Experts
from megazero.moe.moe_utils import expert_capacity
from megazero.moe.router import TopKRouter
from megazero.moe.shared_experts import SharedExpertMLP
from megazero.moe.token_dispatcher import DISPATCHERS
from megazero.tensor_parallel.context import ParallelContext


class MoELayer(nn.Module):
    def __init__(self, config: ModelConfig, *, parallel: ParallelContext | None = None,
                 layer_number: int = 0):
        super().__init__()
        parallel = parallel or ParallelContext()
        moe = config.moe
        assert moe.num_experts is not None, "MoELayer needs --num-experts"
        self.config = config
        self.num_experts = moe.num_experts
        ep, ep_rank = parallel.ep_size, parallel.ep_rank
        if self.num_experts % ep:
            raise ConfigError(f"--num-experts {self.num_experts} is not divisible by "
                              f"--expert-model-parallel-size {ep}")
        if parallel.tp_size > 1 and not parallel.sequence_parallel:
            raise ConfigError("MoE layers with --tensor-model-parallel-size > 1 need "
                              "--sequence-parallel; add it")
        self.local = self.num_experts // ep
        self.first = ep_rank * self.local
        self.parallel = parallel
        sp = parallel.sequence_parallel
        self.router = TopKRouter(config, sum_group=parallel.tp_group if sp else None,
                                 sequence_parallel=sp)
        scope(self.router, "router")
        self.router.layer_number = layer_number
        self.experts = Experts(config, self.first, self.local, dtype=parallel.params_dtype,
                               grouped_gemm=moe.moe_grouped_gemm, etp_group=parallel.etp_group,
                               etp_rank=parallel.etp_rank, etp_size=parallel.etp_size)
        scope(self.experts, "experts")
        self.shared_experts: SharedExpertMLP | None = None
        if moe.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, parallel=parallel)
            scope(self.shared_experts, "shared_experts")
        self.dispatcher_cls = DISPATCHERS[moe.moe_token_dispatcher_type]

    def _pad_capacity(self, local_tokens: int) -> int | None:
        """Rows per expert when inputs are padded to capacity (tokens of the TP group: each
        rank's experts see that many at most from each source rank)."""
        moe = self.config.moe
        if not moe.moe_pad_expert_input_to_capacity:
            return None
        assert moe.moe_expert_capacity_factor is not None
        total = local_tokens * (self.parallel.tp_size if self.parallel.sequence_parallel else 1)
        return expert_capacity(total, self.num_experts, moe.moe_router_topk,
                               moe.moe_expert_capacity_factor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        x = hidden.reshape(s * b, h)
        probs, routing_map = self.router(x, (s, b))
        dispatcher = self.dispatcher_cls(self.num_experts, self.first, self.local,
                                         self.parallel.ep_group, self._pad_capacity(s * b))
        rows, counts = dispatcher.dispatch(x, probs, routing_map)
        etp = ExpertTensorParallelRegion(self.parallel.etp_group)
        rows, counts = etp.gather(rows, counts)
        out = dispatcher.combine(etp.scatter(self.experts(rows, counts))).to(hidden.dtype)
        y = out.view(s, b, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden)
        return self.router.attach_losses(y)
