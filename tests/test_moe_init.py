"""Experts are initialised by their global index: every expert-parallel split holds bitwise
the experts of the one-rank model, and the names they are saved under are global."""

from __future__ import annotations

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.model.init import initialize_parameters
from megazero.moe.moe_layer import MoELayer
from megazero.tensor_parallel.context import ParallelContext


def _cfg() -> ModelConfig:
    return ModelConfig(num_layers=3, hidden_size=8, num_attention_heads=2, vocab_size=64,
                       moe=MoEConfig(num_experts=4, moe_ffn_hidden_size=12, moe_layer_freq=2,
                                     moe_shared_expert_intermediate_size=8,
                                     moe_shared_expert_gate=True))


def test_every_ep_split_holds_the_one_rank_experts_bitwise():
    cfg, topo = _cfg(), ParallelTopology.single()
    full = MoELayer(cfg)
    initialize_parameters(full, cfg, topo, 11)
    want = dict(full.named_parameters())
    for ep in (2, 4):
        seen = set()
        for rank in range(ep):
            part = MoELayer(cfg, parallel=ParallelContext(ep_size=ep, ep_rank=rank))
            initialize_parameters(part, cfg, topo, 11)
            for name, p in part.named_parameters():
                assert torch.equal(p, want[name]), (ep, rank, name)
                seen.add(name)
        assert seen == set(want)  # every expert once, under its global name
    # distinct experts really differ (the key is per expert, not per local slot)
    e0 = want["experts.local_experts.0.linear_fc1.weight"]
    e2 = want["experts.local_experts.2.linear_fc1.weight"]
    assert not torch.equal(e0, e2)


def test_model_names_experts_globally_and_builds_moe_on_the_chosen_layers():
    model = GPTModel(_cfg(), ParallelTopology.single(), seed=3)
    names = [n for n, _ in model.named_parameters()]
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in names
    assert "decoder.layers.2.mlp.router.weight" in names
    assert "decoder.layers.0.mlp.shared_experts.mlp.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names  # layer 1 is dense (freq 2)
    assert not any(n.startswith("decoder.layers.1.mlp.router") for n in names)
    # a pipeline chunk holding layers [2, 3) draws layer 2's experts as the full model does
    chunk = GPTModel(_cfg(), ParallelTopology.single(), layer_range=(2, 3), pre_process=False,
                     seed=3)
    full = dict(model.named_parameters())
    for n, p in chunk.named_parameters():
        if ".mlp." in n:
            assert torch.equal(p, full[n]), n
