"""One call that turns model chunks + configs into a :class:`ZeroOptimizer`."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch
from torch import nn

from megazero.config import ConfigError, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.deepspeed import unimplemented_zero_keys
from megazero.config.rules import sequence_parallel_active
from megazero.distributed.group_comm import GroupComm
from megazero.distributed.topology import ParallelTopology
from megazero.moe.grads import scale_expert_grads, split_expert_params, stage3_experts_own_group
from megazero.zero.buffers import GradBuffer
from megazero.zero.master import MasterParams
from megazero.zero.offload import OffloadPlan
from megazero.zero.optimizer import Comms, ZeroOptimizer
from megazero.zero.optimizers import OptimizerFactory
from megazero.zero.param_gather import register_param_gather_hooks
from megazero.zero.param_store import ParamStore

# zero_optimization keys accepted without an implementation yet: (key, value meaning "off"). The
# DeepSpeed key table marks them TODO and warns once when a config sets them, so the engine does
# not warn again for these.
NO_EFFECT_KEYS: tuple[tuple[str, Any], ...] = unimplemented_zero_keys()

# Keys with a real effect, by stage (the rest of the block is accepted; see NO_EFFECT_KEYS).
IMPLEMENTED_KEYS: dict[str, tuple[int, ...]] = {
    "stage": (0, 1, 2, 3),
    "reduce_bucket_size": (0, 1, 2, 3),
    "overlap_comm": (0, 1, 2, 3),
    "overlap_param_gather": (1, 2),  # Megatron's flag; no JSON key
    "contiguous_gradients": (0, 1),
    "reduce_scatter": (1, 2),
    "allgather_partitions": (1, 2),
    "allgather_bucket_size": (1, 2),
    "offload_optimizer": (1, 2, 3),
    "offload_param": (3,),
    "sub_group_size": (0, 1, 2, 3),
    "ignore_unused_parameters": (0, 1, 2, 3),
    "stage3_prefetch_bucket_size": (3,),
    "stage3_param_persistence_threshold": (3,),
    "stage3_max_live_parameters": (3,),
    "stage3_max_reuse_distance": (3,),
    "aio": (1, 2, 3),  # the top-level "aio" block: NVMe offload's swap-file I/O
}


def check_zero_config(zero: ZeroConfig, topo: ParallelTopology) -> None:
    """Reject what cannot run; warn once per key that is accepted but has no effect."""
    OffloadPlan.from_config(zero)  # the offload keys (megazero.zero.offload.check_offload)
    if zero.offload_optimizer.enabled and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (the "
                          "offloaded optimizer runs on the rank's shard); set stage >= 1")
    if zero.offload_param.enabled and zero.stage != 3:
        warnings.warn("zero_optimization.offload_param has an effect only with stage 3; "
                      "ignored", stacklevel=3)
    if zero.stage >= 2 and not zero.contiguous_gradients:
        warnings.warn("zero_optimization.contiguous_gradients = false has no effect at stage "
                      ">= 2: reduced gradient shards are always contiguous", stacklevel=3)


def deferred_kinds(params: list[nn.Parameter], topo: ParallelTopology, sequence_parallel: bool
                   ) -> dict[int, str]:
    """Parameters whose gradients are summed over another group before the data-parallel
    reduction: ``"sp"`` (over TP: sequence-parallel ones, and ``tp_partial_grad`` ones such as
    the query/key norms, whose grads cover only this rank's heads, with or without SP) and
    ``"emb"`` (tied embedding copies on the first and last pipeline stage, over the embedding
    group)."""
    kinds = {}
    for p in params:
        if sequence_parallel_active(sequence_parallel, topo.tp_size) \
                and getattr(p, "sequence_parallel", False):
            kinds[id(p)] = "sp"
        elif topo.tp_size > 1 and getattr(p, "tp_partial_grad", False):
            kinds[id(p)] = "sp"
        elif topo.pp_size > 1 and getattr(p, "shared_embedding", False):
            kinds[id(p)] = "emb"
    return kinds


def build_zero_optimizer(model_chunks: list[nn.Module] | nn.Module,
                         optimizer_config: OptimizerConfig, zero_config: ZeroConfig,
                         precision_config: PrecisionConfig, topo: ParallelTopology, *,
                         sequence_parallel: bool = False,
                         reduce_scatter_impl: str = "auto",
                         shared_memory: str = "auto",
                         optimizer_factory: OptimizerFactory | None = None,
                         param_groups: list[dict[str, Any]] | None = None,
                         param_init: Any = None,
                         gather_apart: frozenset[int] = frozenset()) -> ZeroOptimizer:
    """Cast the chunks to the training dtype, lay their parameters into flat buffers (stages
    0-2) or shard them (stage 3), and wrap a torch optimizer around this rank's fp32 master
    shard: ``optimizer_factory(groups)`` (default: the one ``optimizer_config`` names), over
    ``param_groups`` (dicts of the chunks' parameters and their settings; default: weight
    decay on matrices only). See :mod:`megazero.zero.optimizers`.

    ``sequence_parallel`` must match how the model was built: it decides whether parameters
    flagged ``sequence_parallel`` have their gradients summed over tensor-parallel ranks.
    ``param_init`` (:class:`megazero.model.init.ParamInitializer`): the chunks were built on the
    meta device; stage 3 materialises only this rank's partition of each unit.
    ``gather_apart`` (parameter ids): at stages 1-2 these get buckets of their own, whose
    post-step gather :meth:`GradBuffer.gather_with` can then encode (``--fp8-param-gather``).
    ``reduce_scatter_impl`` picks how the data-parallel group reduce-scatters, and
    ``shared_memory`` whether its buffers live in shared memory on one host
    (:mod:`megazero.distributed.group_comm`; ``auto`` is right everywhere).
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    check_zero_config(zero_config, topo)
    if zero_config.stage != 3 and any(p.is_meta for c in chunks for p in c.parameters()):
        raise ConfigError(f"parameters on the meta device are materialised by ZeRO stage 3 "
                          f"only (zero_optimization.stage is {zero_config.stage}); build the "
                          "model on a real device for stages 0-2")
    dtype = precision_config.params_dtype
    for chunk in chunks:
        for p in chunk.parameters():
            if p.dtype != dtype and not getattr(p, "keep_fp32", False):  # MoE expert bias
                p.data = p.data.to(dtype)
    comms = Comms.from_topology(topo, reduce_scatter_impl, shared_memory)
    # bf16 gradients accumulate and reduce in fp32 unless the config says otherwise
    # (PrecisionConfig.grad_dtype); the buffers add each micro-batch's gradient into it
    grad_dtype = precision_config.grad_dtype
    stores: list[ParamStore] = []
    expert_comms: Comms | None = None
    for chunk in chunks:
        params = [p for p in chunk.parameters() if p.requires_grad]
        if not params:
            continue
        params, experts = split_expert_params(params, topo, zero_config.stage)
        if experts:  # Mixture-of-Experts weights reduced over their own group
            if expert_comms is None:
                expert_comms = dataclasses.replace(comms, dp=GroupComm(
                    topo.edp_group, "edp", comms.log, reduce_scatter_impl, shared_memory))
            scale_expert_grads(experts, topo)
            stores.append(GradBuffer(
                experts, stage=zero_config.stage, dp=expert_comms.dp,
                bucket_numel=max(1, int(zero_config.reduce_bucket_size)), grad_dtype=grad_dtype,
                contiguous_gradients=zero_config.contiguous_gradients,
                reduce_scatter=zero_config.reduce_scatter, overlap=zero_config.overlap_comm,
                deferred_kind={}, apart=gather_apart))
        kinds = deferred_kinds(params, topo, sequence_parallel)
        if zero_config.stage == 3:
            from megazero.zero.stage3 import Stage3Params

            own = stage3_experts_own_group(params, topo)  # MoE experts partitioned over edp
            if own and expert_comms is None:
                expert_comms = dataclasses.replace(comms, dp=GroupComm(
                    topo.edp_group, "edp", comms.log, reduce_scatter_impl, shared_memory))
            stores.append(Stage3Params(
                chunk, zero_config, comms, grad_dtype, kinds, param_init,
                expert_dp=expert_comms.dp if own and expert_comms is not None else None))
        else:
            buffer = GradBuffer(
                params, stage=zero_config.stage, dp=comms.dp,
                bucket_numel=max(1, int(zero_config.reduce_bucket_size)), grad_dtype=grad_dtype,
                contiguous_gradients=zero_config.contiguous_gradients,
                reduce_scatter=zero_config.reduce_scatter, overlap=zero_config.overlap_comm,
                deferred_kind=kinds, apart=gather_apart)
            if zero_config.overlap_param_gather and zero_config.stage in (1, 2):
                buffer.gather_hooks = register_param_gather_hooks(chunk, buffer)
            stores.append(buffer)
    pieces = [piece for store in stores for piece in store.pieces()]
    plan = OffloadPlan.from_config(zero_config)
    swapper = None
    if plan.optimizer_nvme:
        from megazero.zero.swap import optimizer_swapper

        swapper = functools.partial(optimizer_swapper, zero_config)
    masters = MasterParams(pieces, optimizer_config, offload=plan.optimizer,
                           pin_memory=zero_config.offload_optimizer.pin_memory,
                           sub_group_size=max(1, int(zero_config.sub_group_size)),
                           swapper=swapper, factory=optimizer_factory, groups=param_groups)
    if masters.kind.whole_norms:  # Lamb: each piece's trust ratio is its whole parameter's
        from megazero.optim.whole_norms import WholeParamNorms

        device = next((p.device for s in stores for p in s.params()), torch.device("cpu"))
        masters.norm_reduce = WholeParamNorms(
            [p for s in stores for p in s.params()], comms.dp if zero_config.stage else None,
            comms.tp, topo.tp_rank, device)
    if masters.kind.name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        from megazero.optim import onebit

        if zero_config.stage != 0:
            raise ConfigError(f"{masters.kind.name} runs without ZeRO, as DeepSpeed's: set "
                              f"zero_optimization.stage 0 (this run has {zero_config.stage}), or "
                              "use Adam, AdamW or Lamb")
        onebit.attach(masters.optimizer, stores, comms)
        if masters.kind.name == "OneBitLamb":  # whole-parameter norms over tp, one step
            from megazero.optim.whole_norms import WholeParamNorms

            if len(masters.sub_groups) > 1:
                raise ConfigError(f"OneBitLamb steps every parameter at once: raise "
                                  f"zero_optimization.sub_group_size to at least "
                                  f"{sum(p.model.numel() for p in masters.pieces)}")
            device = next((p.device for s in stores for p in s.params()), torch.device("cpu"))
            opt: Any = masters.optimizer
            opt.whole = WholeParamNorms([p for s in stores for p in s.params()], None, comms.tp,
                                        topo.tp_rank, device)
            opt.owner = {id(pc.master): pc.param for pc in masters.pieces}
    return ZeroOptimizer(stores, masters, comms, topo, zero_config, precision_config,
                         optimizer_config.clip_grad, sequence_parallel)
