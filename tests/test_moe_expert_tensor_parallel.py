"""Expert tensor parallelism at the layer: on 4 gloo ranks, each expert split over ETP 2 or 4
(fc1 by columns, SwiGLU's two halves each, fc2 by rows, fc2's bias whole), alone and with EP 2,
both dispatchers, the expert loop and the grouped GEMM, dropless and padded to capacity. Each
rank's output and input gradient equal the one-rank layer's on that rank's tokens; each expert
slice's gradient is that slice of the one-rank gradient summed over the tokens of the ranks
that computed it (its ETP x EP block; the expert-data-parallel reduction adds the others), and
fc2's bias gets that whole sum on every ETP rank. Every case runs in one spawned world, under the
NCCL-rules mode."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.config.moe_schema import MoEConfig
from megazero.errors import ConfigError
from megazero.tensor_parallel.utils import shard_tensor
from megazero.testing import run_distributed

# (ep, etp, dispatcher, swiglu, grouped gemm, capacity factor)
CASES = [(1, 2, "allgather", True, False, None), (2, 2, "alltoall", False, True, 1.0),
         (1, 4, "alltoall", True, True, None), (2, 2, "allgather", False, False, None)]


def _cfg(disp: str, swiglu: bool, grouped: bool, cap: float | None) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=swiglu,
                       add_bias_linear=True, moe=MoEConfig(
                           num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                           moe_token_dispatcher_type=disp, moe_grouped_gemm=grouped,
                           moe_expert_capacity_factor=cap,
                           moe_pad_expert_input_to_capacity=cap is not None))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)


def _nonzero_biases(layer, swiglu: bool, etp_rank: int = 0, etp: int = 1) -> None:
    """Biases are initialised to zero: give every expert bias (this rank's slice of) a
    seeded non-zero value, so that adding fc2's bias once per ETP group is tested."""
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n.startswith("experts.") and n.endswith("bias"):
                full = torch.randn(p.numel() * (etp if "linear_fc1" in n else 1),
                                   generator=torch.Generator().manual_seed(len(n) + 7 * int(
                                       n.split(".")[2])))
                p.copy_(_slice(full, n, swiglu, etp_rank, etp))


def _world(rank, world_size):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer
    from megazero.tensor_parallel.context import ParallelContext

    single = ParallelTopology.single()
    out = []
    for ep, etp, disp, swiglu, grouped, cap in CASES:
        cfg = _cfg(disp, swiglu, grouped, cap)
        topo = ParallelTopology.build(ep=ep, etp=etp, expert_groups=True)
        layer = MoELayer(cfg, parallel=ParallelContext(ep_group=topo.ep_group,
                                                       etp_group=topo.etp_group))
        initialize_parameters(layer, cfg, single, 9)
        _nonzero_biases(layer, swiglu, topo.etp_rank, etp)
        x, g = _data(rank)
        x.requires_grad_()
        y = layer(x)
        y.backward(g)
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        out.append((y.detach(), x.grad.clone(), grads))
    return out


def _slice(full: torch.Tensor, name: str, swiglu: bool, etp_rank: int, etp: int
           ) -> torch.Tensor:
    """The ETP rank's slice of a one-rank expert tensor."""
    if "linear_fc1" in name:
        return shard_tensor(full, 0, 2 if swiglu else 1, etp_rank, etp)
    if name.endswith("linear_fc2.weight"):
        return shard_tensor(full, 1, 1, etp_rank, etp)
    return full  # fc2's bias: whole


def test_expert_tensor_parallel_layer_equals_the_one_rank_layer():
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer

    results = run_distributed(_world, 4, timeout=300, nccl_rules=True)
    for i, (ep, etp, disp, swiglu, grouped, cap) in enumerate(CASES):
        cfg = _cfg(disp, swiglu, grouped, cap)
        ref = MoELayer(cfg)
        initialize_parameters(ref, cfg, ParallelTopology.single(), 9)
        _nonzero_biases(ref, swiglu)
        per_rank: list[dict[str, torch.Tensor]] = []
        for rank in range(4):
            ref.zero_grad()
            x, g = _data(rank)
            x.requires_grad_()
            y = ref(x)
            y.backward(g)
            got_y, got_dx, _ = results[rank][i]
            what = f"ep{ep} etp{etp} {disp} rank{rank}"
            torch.testing.assert_close(got_y, y.detach(), rtol=1e-5, atol=1e-6, msg=what)
            torch.testing.assert_close(got_dx, x.grad, rtol=1e-5, atol=1e-6, msg=what)
            per_rank.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        block = ep * etp  # ranks whose tokens an expert slice computes
        for rank in range(4):
            first = rank // block * block
            expert_names = [n for n in results[rank][i][2] if n.startswith("experts.")]
            assert len(expert_names) == 4 // ep * 4  # local experts x fc1, fc2 x weight, bias
            for n in expert_names:
                want = sum(per_rank[r][n] for r in range(first, first + block))
                want = _slice(want, n, swiglu, rank % etp, etp)
                torch.testing.assert_close(results[rank][i][2][n], want, rtol=1e-5, atol=1e-6,
                                           msg=f"ep{ep} etp{etp} {disp} rank{rank} {n}")


def test_expert_slices_are_the_one_rank_experts():
    """Layout-independent init: ETP 2's slices of every expert are the one-rank tensors'."""
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters
    from megazero.moe.moe_layer import MoELayer
    from megazero.tensor_parallel.context import ParallelContext

    cfg = _cfg("alltoall", True, False, None)
    ref = MoELayer(cfg)
    initialize_parameters(ref, cfg, ParallelTopology.single(), 3)
    full = dict(ref.named_parameters())
    for r in range(2):
        layer = MoELayer(cfg, parallel=ParallelContext(etp_size=2, etp_rank=r))
        initialize_parameters(layer, cfg, ParallelTopology.single(), 3)
        for n, p in layer.named_parameters():
            want = _slice(full[n].detach(), n, True, r, 2) if n.startswith("experts.") \
                else full[n].detach()
            assert torch.equal(p.detach(), want), (r, n)
        fc2_bias = layer.experts.local_experts["0"].linear_fc2.bias
        assert fc2_bias.expert_tp_duplicate == (r != 0)


def test_expert_ffn_not_divisible_by_etp_is_one_line():
    from megazero.moe.moe_layer import MoELayer
    from megazero.tensor_parallel.context import ParallelContext

    with pytest.raises(ConfigError, match="--moe-ffn-hidden-size 16 is not divisible by "
                       "--expert-tensor-parallel-size 3"):
        MoELayer(_cfg("alltoall", True, False, None),
                 parallel=ParallelContext(etp_size=3, etp_rank=0))
