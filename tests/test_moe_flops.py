"""FLOPs and MFU count an MoE model's active parameters: k experts per token, plus the router
and the shared expert; the planner's meta model holds this rank's experts only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megazero.config import ModelConfig, load_config
from megazero.config.moe_schema import MoEConfig
from megazero.observability.flops import gpt_flops_per_iteration

DENSE = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=256, swiglu=True, ffn_hidden_size=2 * 48)


def test_moe_flops_are_the_dense_flops_of_the_active_experts_plus_the_router():
    moe = replace(DENSE, moe=MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48))
    router = 3.0 * 4 * 32 * 4 * (2 * 64 * 8)  # fwd+bwd x batch x seq x layers x 2hE
    assert gpt_flops_per_iteration(moe, 4) == pytest.approx(
        gpt_flops_per_iteration(DENSE, 4) + router)
    # every other layer MoE, and a gated shared expert of width 32 on those
    half = replace(moe, moe=replace(moe.moe, moe_layer_freq=2,
                                    moe_shared_expert_intermediate_size=32,
                                    moe_shared_expert_gate=True))
    shared = 3.0 * 4 * 32 * 2 * (2 * 64 * 32 * 2 + 2 * 32 * 64 + 2 * 64)
    assert gpt_flops_per_iteration(half, 4) == pytest.approx(
        gpt_flops_per_iteration(DENSE, 4) + router / 2 + shared)


def test_planner_meta_model_holds_this_ranks_experts():
    from megazero.planner.shapes import meta_chunks, shape_topology

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "128", "--num-experts", "8",
            "--moe-ffn-hidden-size", "16", "--disable-bias-linear"]

    def expert_params(ep: int) -> int:
        cfg = load_config([*argv, "--expert-model-parallel-size", str(ep)], world_size=4)
        chunks = meta_chunks(cfg, shape_topology(cfg.layout()))
        return sum(p.numel() for c in chunks for p in c.parameters()
                   if getattr(p, "expert", False))

    per_expert = 2 * (2 * 32 * 16)  # fc1 [f, h] and fc2 [h, f], 2 MoE layers
    assert expert_params(1) == 8 * per_expert
    assert expert_params(4) == 2 * per_expert


def _moe_states_world(rank, world_size):
    from dataclasses import replace as dc_replace

    import torch

    from megazero.distributed.topology import ParallelTopology
    from megazero.planner.model_states import model_state_report
    from megazero.planner.shapes import meta_chunks, shape_topology
    from megazero.training.builders import build_model_and_optimizer

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "1",
            "--train-iters", "1", "--num-experts", "4", "--moe-ffn-hidden-size", "24",
            "--expert-model-parallel-size", "2"]
    base = load_config(argv, world_size)
    topo = ParallelTopology.build(ep=2, expert_groups=True)
    rows = []
    for stage in (0, 1, 2):
        cfg = dc_replace(base, zero=dc_replace(base.zero, stage=stage, reduce_bucket_size=700))
        _, engine = build_model_and_optimizer(cfg, topo, torch.device("cpu"))
        engine.zero_grad()
        assert engine.step().updated
        mem = engine.memory_report()
        layout = cfg.layout()
        chunks = meta_chunks(cfg, shape_topology(layout, 0, topo.dp_rank, 0))
        rep = model_state_report(chunks, cfg.zero, cfg.precision, dp=topo.dp_size,
                                 dp_rank=topo.dp_rank, edp=layout.edp, edp_rank=topo.edp_rank)
        rows.append((stage, (mem["bytes"], mem["padding_elements"]),
                     (rep.bytes, rep.padding_elements)))
    return rows


def test_planner_model_states_equal_the_engine_with_expert_buffers():
    """EP 2 on 2 ranks: expert buffers over an edp group of 1, dense ones over dp 2."""
    from megazero.testing import run_distributed

    for rows in run_distributed(_moe_states_world, 2, timeout=300):
        for stage, measured, predicted in rows:
            assert measured == predicted, stage
