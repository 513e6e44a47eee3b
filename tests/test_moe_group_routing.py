"""Group-limited routing (--moe-router-num-groups, --moe-router-group-topk): each token's
top-k comes only from its best expert groups, a group scored by the sum of its two highest
(bias-shifted) scores. Checked against a token-by-token formula, against transformers'
DeepseekV3TopkRouter (sigmoid, expert bias, routed scaling factor), and at expert parallel 2
(both dispatchers) against the one-rank layer, forward and backward."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.errors import ConfigError
from megazero.moe import moe_utils as mu
from megazero.testing import run_distributed


def _by_hand(scores: torch.Tensor, k: int, groups: int, gk: int) -> list[set[int]]:
    e = scores.shape[1]
    n = e // groups
    chosen = []
    for row in scores.tolist():
        gscore = [sum(sorted(row[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -gscore[g])[:gk]
        allowed = [i for g in best for i in range(g * n, (g + 1) * n)]
        chosen.append(set(sorted(allowed, key=lambda i: -row[i])[:k]))
    return chosen


@pytest.mark.parametrize("e,groups,gk,k", [(8, 4, 2, 3), (8, 2, 1, 2), (6, 3, 2, 4)])
def test_group_limited_topk_is_the_formula(e, groups, gk, k):
    scores = torch.randn(40, e, generator=torch.Generator().manual_seed(e + k))
    _, idx = mu.group_limited_topk(scores, k, groups, gk)
    assert [set(r) for r in idx.tolist()] == _by_hand(scores, k, groups, gk)
    # the limit binds: plain top-k picks experts outside the best groups for some tokens
    plain = [set(r) for r in torch.topk(scores, k).indices.tolist()]
    assert plain != _by_hand(scores, k, groups, gk)


def test_sigmoid_bias_and_scaling_equal_transformers_deepseek_v3_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 16, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(50, 16, generator=g)
    _, w, idx = hf(x)
    want = torch.zeros(50, 8).scatter(1, idx, w)
    logits = x @ hf.weight.t()
    probs, rmap = mu.topk_routing(logits, 3, score_function="sigmoid", scaling_factor=2.5,
                                  expert_bias=hf.e_score_correction_bias, num_groups=4,
                                  group_topk=2)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(rmap, want > 0)
    # without the group limit the choice differs for some tokens (the test can fail)
    free, _ = mu.topk_routing(logits, 3, score_function="sigmoid", scaling_factor=2.5,
                              expert_bias=hf.e_score_correction_bias)
    assert not torch.equal(free > 0, want > 0)


def test_group_flags_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="--moe-router-num-groups 3 must divide"):
        MoEConfig(num_experts=8, moe_router_num_groups=3, moe_router_group_topk=1)
    with pytest.raises(ConfigError, match="--moe-router-group-topk 1 needs"):
        MoEConfig(num_experts=8, moe_router_group_topk=1)
    with pytest.raises(ConfigError, match="--moe-router-topk 6 exceeds the 4 experts"):
        MoEConfig(num_experts=8, moe_router_topk=6, moe_router_num_groups=4,
                  moe_router_group_topk=2)


DISPATCHERS = ("allgather", "alltoall")


def _cfg(disp: str, dtype: str | None = None) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=True,
                       add_bias_linear=False, moe=MoEConfig(
                           num_experts=8, moe_ffn_hidden_size=12, moe_router_topk=2,
                           moe_router_num_groups=4, moe_router_group_topk=2,
                           moe_router_score_function="sigmoid",
                           moe_router_enable_expert_bias=True,
                           moe_router_topk_scaling_factor=2.0, moe_router_dtype=dtype,
                           moe_router_load_balancing_type="seq_aux_loss",
                           moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=disp))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)


def _layer(cfg: ModelConfig, parallel=None):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer

    layer = MoELayer(cfg) if parallel is None else MoELayer(cfg, parallel=parallel)
    initialize_parameters(layer, cfg, ParallelTopology.single(), 4)
    assert layer.router.expert_bias is not None
    with torch.no_grad():  # a bias that changes the choice
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    return layer


def _world(rank, world_size):
    from megazero.distributed.topology import ParallelTopology
    from megazero.tensor_parallel.context import ParallelContext

    topo = ParallelTopology.build(ep=2, expert_groups=True)
    out = []
    for disp in DISPATCHERS:
        layer = _layer(_cfg(disp), ParallelContext(ep_group=topo.ep_group))
        x, g = _data(rank)
        x.requires_grad_()
        y = layer(x)
        y.backward(g)
        out.append((y.detach(), x.grad.clone(), layer.router.weight.grad.clone(),
                    {n: p.grad.clone() for n, p in layer.named_parameters()
                     if n.startswith("experts.")}))
    return out


def test_expert_parallel_2_routes_by_group_as_one_rank():
    results = run_distributed(_world, 2, timeout=240)
    for i, disp in enumerate(DISPATCHERS):
        ref = _layer(_cfg(disp))
        expert_grads: list[dict[str, torch.Tensor]] = []
        for rank in range(2):
            ref.zero_grad()
            x, g = _data(rank)
            x.requires_grad_()
            y = ref(x)
            y.backward(g)
            got_y, got_dx, got_router, _ = results[rank][i]
            torch.testing.assert_close(got_y, y.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_dx, x.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_router, ref.router.weight.grad, rtol=1e-5,
                                       atol=1e-6)
            expert_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()
                                 if n.startswith("experts.")})
        for rank in range(2):
            for n, grad in results[rank][i][3].items():
                torch.testing.assert_close(grad, expert_grads[0][n] + expert_grads[1][n],
                                           rtol=1e-5, atol=1e-6, msg=f"{disp} {n}")


def test_fp64_router_chooses_as_fp32_on_separated_scores():
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    a = _layer(_cfg("allgather"))
    b = _layer(_cfg("allgather", "fp64"))
    pa, ma = a.router(x, (6, 2))
    pb, mb = b.router(x, (6, 2))
    assert pb.dtype == torch.float32
    assert torch.equal(ma, mb)
    torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
