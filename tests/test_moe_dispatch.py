"""Expert parallelism at the layer: on 4 gloo ranks, EP 2 and 4 with both dispatchers, dropless
and with a capacity factor padded to capacity, each rank's output and input gradient equal the
one-rank layer's on that rank's tokens, and each expert's gradient equals the one-rank
gradient summed over the tokens of its expert-parallel group (the expert-data-parallel
reduction adds the other groups').
Every case runs in one spawned world, under the NCCL-rules mode (variable all-to-all splits
included)."""

from __future__ import annotations

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.testing import run_distributed

CASES = [(ep, disp, cap) for ep in (2, 4) for disp in ("allgather", "alltoall")
         for cap in (None, 1.0)]


def _cfg(disp: str, cap: float | None) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=True,
                       add_bias_linear=False, moe=MoEConfig(
                           num_experts=4, moe_ffn_hidden_size=12, moe_router_topk=2,
                           moe_token_dispatcher_type=disp, moe_expert_capacity_factor=cap,
                           moe_pad_expert_input_to_capacity=cap is not None,
                           moe_aux_loss_coeff=1e-2))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)


def _world(rank, world_size):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer
    from megazero.tensor_parallel.context import ParallelContext

    single = ParallelTopology.single()
    topos = {ep: ParallelTopology.build(ep=ep, expert_groups=True) for ep in (2, 4)}
    out = []
    for ep, disp, cap in CASES:
        cfg = _cfg(disp, cap)
        topo = topos[ep]
        layer = MoELayer(cfg, parallel=ParallelContext(ep_group=topo.ep_group))
        initialize_parameters(layer, cfg, single, 9)
        x, g = _data(rank)
        x.requires_grad_()
        y = layer(x)
        y.backward(g)
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        out.append((y.detach(), x.grad.clone(), grads))
    return out


def test_expert_parallel_layer_equals_the_one_rank_layer():
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer

    results = run_distributed(_world, 4, timeout=300, nccl_rules=True)
    for i, (ep, disp, cap) in enumerate(CASES):
        cfg = _cfg(disp, cap)
        ref = MoELayer(cfg)
        initialize_parameters(ref, cfg, ParallelTopology.single(), 9)
        per_rank: list[dict[str, torch.Tensor]] = []
        for rank in range(4):
            ref.zero_grad()
            x, g = _data(rank)
            x.requires_grad_()
            y = ref(x)
            y.backward(g)
            got_y, got_dx, got_grads = results[rank][i]
            what = f"ep{ep} {disp} cap={cap} rank{rank}"
            torch.testing.assert_close(got_y, y.detach(), rtol=1e-5, atol=1e-6, msg=what)
            torch.testing.assert_close(got_dx, x.grad, rtol=1e-5, atol=1e-6, msg=what)
            torch.testing.assert_close(got_grads["router.weight"], ref.router.weight.grad,
                                       rtol=1e-5, atol=1e-6, msg=what)
            per_rank.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        for rank in range(4):
            group = range(rank // ep * ep, rank // ep * ep + ep)  # its expert-parallel group
            for n, grad in results[rank][i][2].items():
                if n.startswith("experts."):
                    want = sum(per_rank[r][n] for r in group)
                    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6,
                                               msg=f"ep{ep} {disp} cap={cap} rank{rank} {n}")
