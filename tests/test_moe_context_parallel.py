"""The router under context parallelism: each CP rank routes its zigzag share of the sequence
(cut again into TP slices under sequence parallelism), yet capacity, the tokens dropped (by
weight and by position), the balancing losses (aux and per sequence) and the z-loss are those
of the whole micro-batch. On 4 gloo ranks, CP 4 and TP 2 + SP x CP 2: each rank's output is its
share of the one-rank layer's; as in training, each rank back-propagates CP times its share
(the CP loss, megazero.context_parallel.loss), so its input gradient is CP times its share of
the one-rank one and the router's and experts' gradients summed over the ranks and divided by
CP (what the dp x cp gradient average does) equal the one-rank gradients. The world runs
under the NCCL rules (no host tensor reaches a collective; every rank's collectives agree)."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.testing import run_distributed

CASES = [dict(moe_router_load_balancing_type="aux_loss", moe_expert_capacity_factor=0.75,
              moe_token_drop_policy="probs"),
         dict(moe_router_load_balancing_type="seq_aux_loss", moe_expert_capacity_factor=0.75,
              moe_token_drop_policy="position", moe_z_loss_coeff=0.1),
         dict(moe_router_score_function="sigmoid", moe_z_loss_coeff=0.1,
              moe_expert_capacity_factor=1.0, moe_token_drop_policy="position",
              moe_pad_expert_input_to_capacity=True)]
LAYOUTS = [(1, 4), (2, 2)]  # (tp, cp) on 4 ranks


def _cfg(case: dict) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=True,
                       add_bias_linear=False, moe=MoEConfig(
                           num_experts=4, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.5,
                           **case))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(16, 3, 8, generator=g), torch.randn(16, 3, 8, generator=g)


def _share(t: torch.Tensor, tp: int, cp: int, rank: int) -> torch.Tensor:
    """The ``[s, b, h]`` rows global ``rank`` holds: its CP zigzag share, then its SP slice."""
    from megazero.context_parallel.split import split

    return split(t, 0, (rank // tp) % cp, cp).chunk(tp)[rank % tp]


def _world(rank, world_size):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer
    from megazero.tensor_parallel.context import ParallelContext

    out = []
    for tp, cp in LAYOUTS:
        topo = ParallelTopology.build(tp=tp, cp=cp, expert_groups=True)
        parallel = ParallelContext.from_topology(topo, sequence_parallel=tp > 1)
        for case in CASES:
            cfg = _cfg(case)
            layer = MoELayer(cfg, parallel=parallel)
            initialize_parameters(layer, cfg, ParallelTopology.single(), 4)
            x, g = _data()
            xs = _share(x, tp, cp, rank).clone().requires_grad_()
            y = layer(xs)
            y.backward(cp * _share(g, tp, cp, rank))
            stats = layer.router.stats
            out.append((y.tolist(), xs.grad.tolist(),  # plain lists travel back safely
                        {n: p.grad.tolist() for n, p in layer.named_parameters()},
                        stats.load_balancing_loss.item(), stats.z_loss.item(),
                        stats.tokens_per_expert.tolist(), stats.dropped_fraction.item()))
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_world, 4, timeout=300, nccl_rules=True)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["cp4", "tp2sp-cp2"])
def test_context_parallel_router_equals_the_whole_micro_batch(results, layout):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer

    tp, cp = layout
    base = LAYOUTS.index(layout) * len(CASES)
    for i, case in enumerate(CASES):
        cfg = _cfg(case)
        ref = MoELayer(cfg)
        initialize_parameters(ref, cfg, ParallelTopology.single(), 4)
        x, g = _data()
        x.requires_grad_()
        y = ref(x)
        y.backward(g)
        want = ref.router.stats
        what = f"tp{tp} cp{cp} {case}"
        got = [results[rank][base + i] for rank in range(4)]
        for rank, (got_y, got_dx, _, lb, zl, counts, dropped) in enumerate(got):
            torch.testing.assert_close(torch.tensor(got_y), _share(y.detach(), tp, cp, rank),
                                       msg=what)
            torch.testing.assert_close(torch.tensor(got_dx), cp * _share(x.grad, tp, cp, rank),
                                       msg=what)
            assert lb == pytest.approx(want.load_balancing_loss.item(), rel=1e-6), what
            assert zl == pytest.approx(want.z_loss.item(), rel=1e-6), what
            assert counts == want.tokens_per_expert.tolist(), what
            assert dropped == pytest.approx(want.dropped_fraction.item(), abs=1e-7), what
        if case.get("moe_expert_capacity_factor") == 0.75:
            assert want.dropped_fraction.item() > 0, what  # the comparison covers dropping
        for n, p in ref.named_parameters():
            summed = sum(torch.tensor(r[2][n]) for r in got) / cp
            torch.testing.assert_close(summed, p.grad, rtol=1e-5, atol=1e-6, msg=f"{what} {n}")


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_token_rows_place_the_cp_shares_in_the_whole_micro_batch(cp):
    from megazero.context_parallel.split import split
    from megazero.moe.moe_utils import zigzag_token_rows

    s, b = 16, 3
    whole = torch.arange(s * b).view(s, b)  # token rows as the router flattens [s, b]
    shares = torch.cat([split(whole, 0, r, cp).reshape(-1) for r in range(cp)])
    assert torch.equal(whole.reshape(-1)[zigzag_token_rows(s, b, cp)], shares)
