"""The routers' logged scalars against what each forward measured."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.init import initialize_parameters
from megazero.moe import metrics
from megazero.moe.moe_layer import MoELayer


def test_collect_averages_losses_and_counts_tokens_per_iteration():
    cfg = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, moe=MoEConfig(
        num_experts=4, moe_ffn_hidden_size=8, moe_expert_capacity_factor=0.75,
        moe_z_loss_coeff=1e-3))
    topo = ParallelTopology.single()
    layer = MoELayer(cfg, layer_number=1)
    initialize_parameters(layer, cfg, topo, 2)
    seen = []
    for seed in range(3):  # 3 micro-batches over an interval of 3 iterations
        layer(torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(seed)))
        seen.append(layer.router.stats)
    with torch.no_grad():  # an evaluation forward is not counted
        layer(torch.randn(6, 2, 8))
    out = metrics.collect([layer], topo, num_layers=2, num_experts=4, iterations=3,
                          per_layer=True)
    lb = sum(s.load_balancing_loss.item() for s in seen) / 3
    counts = sum(s.tokens_per_expert for s in seen) / 3
    assert out["load_balancing_loss"] == pytest.approx(lb)
    assert out["moe/load_balancing_loss_layer_1"] == pytest.approx(lb)
    assert out["z_loss"] == pytest.approx(sum(s.z_loss.item() for s in seen) / 3)
    assert out["moe/tokens_per_expert_min"] == pytest.approx(counts.min().item())
    assert out["moe/tokens_per_expert_max"] == pytest.approx(counts.max().item())
    kept = sum(s.tokens_per_expert.sum().item() for s in seen)
    assert out["moe/dropped_token_fraction"] == pytest.approx(1 - kept / (3 * 12 * 2))
    assert out["moe/dropped_token_fraction"] > 0  # capacity 0.75 drops
    assert layer.router.metrics_acc.abs().sum() == 0  # reset for the next interval
    line = metrics.log_line_part(out)
    assert "load_balancing_loss: " in line and "tokens per expert min/max: " in line
