"""The router under sequence parallelism: each TP rank routes its slice of the sequence, yet
capacity, dropping, the balancing losses (aux and per sequence) and the z-loss are those of the
whole micro-batch. On 2 gloo ranks (TP 2 + SP, EP 1) each rank's output and input gradient are
its slice of the one-rank layer's, and the router's and experts' gradients summed over the TP
group (what the gradient sync does for them) equal the one-rank gradients."""

from __future__ import annotations

import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.testing import run_distributed

CASES = [dict(moe_router_load_balancing_type="aux_loss", moe_expert_capacity_factor=0.75,
              moe_token_drop_policy="probs"),
         dict(moe_router_load_balancing_type="seq_aux_loss", moe_expert_capacity_factor=0.75,
              moe_token_drop_policy="position", moe_z_loss_coeff=0.1),
         dict(moe_router_score_function="sigmoid", moe_z_loss_coeff=0.1)]


def _cfg(case: dict) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=True,
                       add_bias_linear=False, moe=MoEConfig(
                           num_experts=4, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.5,
                           **case))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 3, 8, generator=g), torch.randn(8, 3, 8, generator=g)


def _world(rank, world_size):
    import torch.distributed as dist

    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer
    from megazero.tensor_parallel.context import ParallelContext

    out = []
    for case in CASES:
        cfg = _cfg(case)
        layer = MoELayer(cfg, parallel=ParallelContext(tp_group=dist.group.WORLD,
                                                       sequence_parallel=True))
        initialize_parameters(layer, cfg, ParallelTopology.single(), 4)
        x, g = _data()
        xs = x.chunk(2)[rank].clone().requires_grad_()
        y = layer(xs)
        y.backward(g.chunk(2)[rank])
        out.append((y.tolist(), xs.grad.tolist(),  # plain lists travel back safely
                    {n: p.grad.tolist() for n, p in layer.named_parameters()},
                    layer.router.stats.load_balancing_loss.item()))
    return out


def test_sequence_parallel_router_equals_the_whole_micro_batch():
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer

    results = run_distributed(_world, 2, timeout=300)
    for i, case in enumerate(CASES):
        cfg = _cfg(case)
        ref = MoELayer(cfg)
        initialize_parameters(ref, cfg, ParallelTopology.single(), 4)
        x, g = _data()
        x.requires_grad_()
        y = ref(x)
        y.backward(g)
        for rank in range(2):
            got_y, got_dx, _, lb = results[rank][i]
            got_y, got_dx = torch.tensor(got_y), torch.tensor(got_dx)
            torch.testing.assert_close(got_y, y.detach().chunk(2)[rank], msg=str(case))
            torch.testing.assert_close(got_dx, x.grad.chunk(2)[rank], msg=str(case))
            assert abs(lb - ref.router.stats.load_balancing_loss.item()) < 1e-6, case
        for n, p in ref.named_parameters():
            summed = torch.tensor(results[0][i][2][n]) + torch.tensor(results[1][i][2][n])
            torch.testing.assert_close(summed, p.grad,
                                       rtol=1e-5, atol=1e-6, msg=f"{case} {n}")
