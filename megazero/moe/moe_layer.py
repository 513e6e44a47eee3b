"""The MoE block that replaces a layer's MLP: router, dispatcher, local experts and optional
shared experts (megatron-core's ``MoELayer``).

``y = sum_{e in top-k(x)} p_e FFN_e(x) + shared(x)``, on ``[s(/t), b, h]`` activations as the
dense MLP takes them. Under sequence parallelism each TP rank routes its own slice of tokens
(the router sums counts and scores over the TP group so capacity and the balancing loss see
the whole micro-batch); experts are split over the expert-parallel group, and each expert
over the expert-tensor-parallel group (:mod:`megazero.moe.expert_tp`). Under context
parallelism each CP rank routes its zigzag share of the sequence, and the router counts over
the TP x CP group (:func:`token_group`).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.distributed.collectives import Group, group_size
from megazero.errors import ConfigError
from megazero.model.init import scope
from megazero.moe.expert_tp import ExpertTensorParallelRegion
from megazero.moe.experts import Experts
from megazero.moe.moe_utils import expert_capacity
from megazero.moe.router import TopKRouter
from megazero.moe.shared_experts import SharedExpertMLP
from megazero.moe.token_dispatcher import DISPATCHERS
from megazero.tensor_parallel.context import ParallelContext


def token_group(parallel: ParallelContext) -> Group:
    """The ranks whose tokens make one micro-batch of one data replica (the router's sum
    group): TP under sequence parallelism, CP, or TP x CP; None when this rank holds them all.
    """
    if parallel.cp_size > 1:
        if parallel.tp_size == 1:
            return parallel.cp_group
        if parallel.tp_cp_group is None:
            raise ConfigError("an MoE layer with tensor and context parallelism needs the "
                              "TP x CP group; build its ParallelContext with "
                              "ParallelContext.from_topology")
        return parallel.tp_cp_group
    return parallel.tp_group if parallel.sequence_parallel else None


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
        self.token_group = token_group(parallel)
        self.router = TopKRouter(config, sum_group=self.token_group, sequence_parallel=sp,
                                 cp_size=parallel.cp_size)
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
        """Rows per expert when inputs are padded to capacity (tokens of the router's group:
        each rank's experts see that many at most from each source rank)."""
        moe = self.config.moe
        if not moe.moe_pad_expert_input_to_capacity:
            return None
        assert moe.moe_expert_capacity_factor is not None
        total = local_tokens * (1 if self.token_group is None else group_size(self.token_group))
        return expert_capacity(total, self.num_experts, moe.moe_router_topk,
                               moe.moe_expert_capacity_factor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        x = hidden.reshape(s * b, h)
        probs, routing_map = self.router(x, (s, b))
        dispatcher = self.dispatcher_cls(self.num_experts, self.first, self.local,
                                         self.parallel.ep_group, self._pad_capacity(s * b))
        shared: list[torch.Tensor] = []
        under = None
        if self.shared_experts is not None and self.config.moe.moe_shared_expert_overlap:
            def under() -> None:  # the shared expert while the dispatch is in flight
                assert self.shared_experts is not None
                shared.append(self.shared_experts(hidden))
        rows, counts = dispatcher.dispatch(x, probs, routing_map, under)
        etp = ExpertTensorParallelRegion(self.parallel.etp_group)
        rows, counts = etp.gather(rows, counts)
        out = dispatcher.combine(etp.scatter(self.experts(rows, counts))).to(hidden.dtype)
        y = out.view(s, b, h)
        if self.shared_experts is not None:
            y = y + (shared[0] if shared else self.shared_experts(hidden))
        return self.router.attach_losses(y)
