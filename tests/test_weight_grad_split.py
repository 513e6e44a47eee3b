"""The backward split into B (input gradient) and W (weight gradients): after W every
parameter's gradient equals that of one ordinary backward, and the post-accumulate hooks (what
the ZeRO buckets and main-grad buffers listen to) fire once per parameter, in W, never in B.

One world of two ranks at TP 2 covers the column- and row-parallel linears (with and without
sequence parallelism), the vocab-parallel embedding and output layer, norms and biases, full
recompute, and the MoE experts (loop and grouped GEMM); the same cases run at TP 1 on each
rank too.
"""

import torch

from megazero.config import RecomputeConfig
from megazero.config.moe_schema import MoEConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import weight_grad
from megazero.tensor_parallel.context import ParallelContext
from megazero.testing import run_distributed
from megazero.testing.tiny_gpt import batch, tiny_config

CASES = [
    ("gpt2", {}, False, RecomputeConfig()),
    ("gpt2", {}, True, RecomputeConfig("full", "uniform", 1)),
    ("llama", {}, True, RecomputeConfig("selective")),
    ("llama", {"moe": MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)},
     True, RecomputeConfig()),
    ("llama", {"moe": MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                                moe_grouped_gemm=True)}, True, RecomputeConfig()),
]


def _model(preset, kw, sp, recompute, topo):
    cfg = tiny_config(preset, **kw)
    torch.manual_seed(0)
    return GPTModel(cfg, topo, recompute=recompute,
                    parallel=ParallelContext.from_topology(topo, sequence_parallel=sp))


def _split_case(rank, world):
    tokens, labels = batch()
    out = []
    for tp in (1, 2):
        topo = ParallelTopology.build(tp=tp) if tp > 1 else ParallelTopology.single()
        for preset, kw, sp, recompute in CASES:
            sp = sp and tp > 1
            what = f"tp={tp} {preset} {sorted(kw)} sp={sp} {recompute.granularity}"
            ref = _model(preset, kw, sp, recompute, topo)
            ref(tokens, labels).mean().backward()
            model = _model(preset, kw, sp, recompute, topo)
            params = [p for p in model.parameters() if p.requires_grad]
            fired: list[str] = []
            names = {id(p): n for n, p in model.named_parameters()}
            for p in params:
                p.register_post_accumulate_grad_hook(
                    lambda t, fired=fired, names=names: fired.append(names[id(t)]))
            store = weight_grad.WeightGradStore(params)
            loss = model(tokens, labels).mean()
            with weight_grad.deferring(store):
                weight_grad.backward([loss], [torch.ones_like(loss)], [])
            assert not fired, f"{what}: hooks fired in B: {fired[:3]}"
            assert all(p.grad is None for p in params), f"{what}: a .grad written in B"
            deferred = sum(1 for _ in store._closures)
            assert deferred > 0, f"{what}: no weight-gradient GEMM was deferred"
            store.run()
            assert sorted(fired) == sorted(names.values()), f"{what}: hooks {sorted(fired)}"
            worst = 0.0
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                assert q.grad is not None and p.grad is not None, f"{what}: {n} has no grad"
                err = (p.grad - q.grad).abs().max().item()
                assert err <= 1e-6 * q.grad.abs().max().item() + 1e-9, f"{what}: d{n} {err}"
                worst = max(worst, err)
            out.append((what, deferred, worst))
    return out


def test_weight_grads_after_w_equal_one_backward_and_hooks_fire_in_w():
    res = run_distributed(_split_case, 2, timeout=240)
    assert len(res[0]) == 10
    assert res[0] == res[1] or [r[:2] for r in res[0]] == [r[:2] for r in res[1]]


def test_no_store_means_weight_grads_now():
    """Outside ``deferring`` the layers compute their weight gradients in backward as before,
    and an expert-gradient pre-hook applies once per contribution inside W."""
    p = torch.nn.Parameter(torch.ones(3, 2))
    x = torch.ones(4, 2, requires_grad=True)
    from megazero.tensor_parallel.layers import DEFAULT_GEMM, LinearSavingWeight

    LinearSavingWeight.apply(x, p, DEFAULT_GEMM).sum().backward()
    assert torch.equal(p.grad, torch.full((3, 2), 4.0))
    p.grad = None
    p.register_hook(lambda g: g * 2)
    store = weight_grad.WeightGradStore([p])
    with weight_grad.deferring(store):
        y = LinearSavingWeight.apply(x, p, DEFAULT_GEMM)
        (gx,) = weight_grad.backward([y.sum()], [None], [x])
    assert p.grad is None and torch.equal(gx, torch.full((4, 2), 3.0))
    store.run()
    assert torch.equal(p.grad, torch.full((3, 2), 8.0))

