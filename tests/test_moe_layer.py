"""The MoE layer at one rank against the dense formula ``sum_k p_k FFN_k(x)``, token by token,
forward and backward; the grouped GEMM against the loop; routing options, capacity and the
balancing losses against their definitions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.init import initialize_parameters
from megazero.moe import moe_utils as mu
from megazero.moe.moe_layer import MoELayer


def _config(**moe) -> ModelConfig:
    base = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    return ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, swiglu=True,
                       add_bias_linear=False, moe=MoEConfig(**{**base, **moe}))


def _layer(cfg: ModelConfig, seed: int = 5) -> MoELayer:
    layer = MoELayer(cfg)
    initialize_parameters(layer, cfg, ParallelTopology.single(), seed)
    return layer


def _ffn(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer.experts.local_experts[str(e)]
    gate, up = (x @ ex.linear_fc1.weight.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ ex.linear_fc2.weight.t()


def _reference(layer: MoELayer, x: torch.Tensor, *, pre_softmax: bool = False,
               sigmoid: bool = False, scale: float | None = None) -> torch.Tensor:
    """Token by token: pick the top-k experts by hand, weigh, sum."""
    k = layer.router.topk
    out = []
    for tok in x:
        logits = layer.router.weight @ tok
        if sigmoid:
            s = torch.sigmoid(logits)
            idx = torch.topk(s, k).indices
            w = s[idx] / s[idx].sum()
        elif pre_softmax:
            s = torch.softmax(logits, 0)
            idx = torch.topk(s, k).indices
            w = s[idx]
        else:
            idx = torch.topk(logits, k).indices
            w = torch.softmax(logits[idx], 0)
        if scale is not None:
            w = w * scale
        out.append(sum(w[j] * _ffn(layer, int(idx[j]), tok) for j in range(k)))
    return torch.stack(out)


@pytest.mark.parametrize("opts", [
    {}, {"moe_router_pre_softmax": True},
    {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5},
    {"moe_grouped_gemm": True}, {"moe_token_dispatcher_type": "alltoall"},
])
def test_dropless_layer_equals_dense_loop_forward_and_backward(opts):
    cfg = _config(moe_router_load_balancing_type="none", **opts)
    layer = _layer(cfg)
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = layer(x)
    ref_layer = _layer(cfg)
    xr = x.detach().clone().requires_grad_()
    ref = _reference(ref_layer, xr.reshape(15, 8),
                     pre_softmax=opts.get("moe_router_pre_softmax", False),
                     sigmoid="moe_router_score_function" in opts,
                     scale=opts.get("moe_router_topk_scaling_factor")).view(5, 3, 8)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(layer.named_parameters(), ref_layer.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_grouped_gemm_equals_loop_with_biases_gelu_and_an_idle_expert():
    cfg = replace(_config(moe_router_load_balancing_type="none"), swiglu=False,
                  add_bias_linear=True)
    loop, grouped = _layer(cfg), _layer(replace(cfg, moe=replace(cfg.moe,
                                                                 moe_grouped_gemm=True)))
    with torch.no_grad():
        loop.router.weight[3] = -100.0  # expert 3 receives no token
        grouped.router.weight[3] = -100.0
        for layer in (loop, grouped):
            for p in layer.experts.parameters():
                if p.dim() == 1:
                    p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    x = torch.rand(4, 2, 8, generator=torch.Generator().manual_seed(1)) + 0.1  # > 0
    ya, yb = loop(x), grouped(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for p, q in zip(loop.parameters(), grouped.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert loop.experts.local_experts["3"].linear_fc1.weight.grad.abs().sum() == 0


def test_switch_loss_is_one_at_balance_and_its_gradient_reaches_the_router():
    t, e, k = 8, 4, 2
    uniform = torch.full((t, e), 1.0 / e)
    counts = torch.full((e,), t * k / e)
    assert mu.switch_load_balancing_loss(uniform, counts, k, t).item() == pytest.approx(1.0)
    cfg = _config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    layer = _layer(cfg)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(2))
    layer(x).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    plain = _layer(replace(cfg, moe=replace(cfg.moe, moe_aux_loss_coeff=0.0,
                                             moe_z_loss_coeff=None)))
    plain(x).sum().backward()
    # the difference is exactly the gradient of coeff*aux + zcoeff*z
    w = plain.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, 8) @ w.t()
    _, rmap = mu.topk_routing(logits.detach(), 2)
    aux = mu.switch_load_balancing_loss(torch.softmax(logits, -1), rmap.sum(0).float(), 2, 8)
    (0.5 * aux + 0.1 * mu.z_loss(logits)).backward()
    torch.testing.assert_close(with_aux - plain.router.weight.grad, w.grad, rtol=1e-4,
                               atol=1e-7)


def test_seq_aux_loss_is_the_mean_of_per_sequence_switch_losses():
    cfg = _config(moe_router_load_balancing_type="seq_aux_loss")
    layer = _layer(cfg)
    x = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(3))
    layer(x)
    logits = x @ layer.router.weight.t()  # [s, b, E]
    want = 0.0
    for b in range(3):
        _, rmap = mu.topk_routing(logits[:, b], 2)
        want += mu.switch_load_balancing_loss(torch.softmax(logits[:, b], -1),
                                              rmap.sum(0).float(), 2, 6).item()
    assert layer.router.stats.load_balancing_loss.item() == pytest.approx(want / 3, rel=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_by_policy_and_padding_changes_nothing(policy):
    cfg = _config(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy,
                  moe_router_load_balancing_type="none")
    t, e, k = 12, 4, 2
    cap = mu.expert_capacity(t, e, k, 0.5)
    assert cap == math.ceil(2 * 12 / 4 * 0.5) == 3
    layer = _layer(cfg)
    x = torch.randn(t, 1, 8, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    logits = x.reshape(t, 8) @ layer.router.weight.t()
    probs, rmap = mu.topk_routing(logits, k)
    keep = torch.zeros_like(rmap)
    for j in range(e):
        chosen = [i for i in range(t) if rmap[i, j]]
        if policy == "probs":
            chosen = sorted(chosen, key=lambda i: (-probs[i, j].item(), i))
        keep[chosen[:cap], j] = True
    stats = layer.router.stats
    assert stats.tokens_per_expert.tolist() == keep.sum(0).float().tolist()
    assert stats.dropped_fraction.item() == pytest.approx(1 - keep.sum().item() / (t * k))
    want = torch.stack([sum(probs[i, j] * _ffn(layer, j, x[i, 0]) for j in range(e)
                            if keep[i, j]) + torch.zeros(8) for i in range(t)])
    torch.testing.assert_close(y.view(t, 8), want, rtol=1e-5, atol=1e-6)
    padded = _layer(replace(cfg, moe=replace(cfg.moe, moe_pad_expert_input_to_capacity=True)))
    torch.testing.assert_close(padded(x), y, rtol=0, atol=0)


def test_expert_bias_moves_toward_balance_and_shared_expert_gate_adds_its_mlp():
    cfg = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=0.25, moe_shared_expert_intermediate_size=8,
                  moe_shared_expert_gate=True, moe_router_load_balancing_type="none")
    layer = _layer(cfg)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(6))
    y = layer(x)
    counts = layer.router.local_tokens_per_expert.clone()
    layer.router.update_expert_bias()
    assert layer.router.expert_bias.tolist() == (0.25 * torch.sign(counts.mean() - counts)
                                                 ).tolist()
    assert layer.router.local_tokens_per_expert.sum() == 0
    assert "router.expert_bias" in layer.state_dict()
    sh = layer.shared_experts
    gate = torch.sigmoid(x @ sh.gate_weight.t())
    routed = _reference(layer, x.reshape(12, 8), sigmoid=True).view(6, 2, 8)
    layer.router.expert_bias.zero_()
    torch.testing.assert_close(y, routed + gate * sh.mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [8, 6])  # 6 fp32 columns are not 16-byte aligned: the mm loop
def test_grouped_linear_forward_and_backward_equal_per_segment_mm(k):
    from megazero.moe.experts import grouped_linear

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, k, generator=g, requires_grad=True)
    w = torch.randn(3, 12, k, generator=g, requires_grad=True)
    counts = [4, 0, 5]
    y = grouped_linear(x, w, counts)
    ref = torch.cat([x[:4] @ w[0].t(), x[4:] @ w[2].t()])
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), gy)
    rx, rw = torch.autograd.grad(ref, (x, w), gy)
    torch.testing.assert_close(dx, rx)
    torch.testing.assert_close(dw, rw)


def test_bf16_layer_routes_in_fp32_and_keeps_the_expert_bias_fp32():
    cfg = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_grouped_gemm=True)
    ref = _layer(cfg)
    layer = _layer(cfg)
    for p in layer.parameters():  # as the engine casts a bf16 run's weights
        if not getattr(p, "keep_fp32", False):
            p.data = p.data.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(8))
    y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref(x), rtol=3e-2, atol=3e-3)
    y.float().sum().backward()
    assert layer.router.weight.grad is not None
