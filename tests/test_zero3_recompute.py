"""ZeRO-3 with full activation recomputation trains exactly the model ZeRO-3 trains without it.

The recomputed forward runs inside the backward, after the later layers' backward: prefetching
the units that follow it in forward order would gather weights nobody needs any more, and a
unit still gathered at the optimizer step would carry the old weights into the next forward.
Units are small enough here that none is persistent (the path real models take)."""

import pytest
import torch

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.sections import RecomputeConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.testing.tiny_gpt import batch, tiny_config
from megazero.zero import build_zero_optimizer
from megazero.zero.stage3 import Stage3Params

ZERO3 = dict(stage=3, stage3_param_persistence_threshold=0)


def _train(stage_kw, recompute, steps=3, on_gather=None):
    torch.manual_seed(0)
    topo = ParallelTopology.single()
    model = GPTModel(tiny_config("gpt2", num_layers=3), topo, recompute=recompute)
    engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-2), ZeroConfig(**stage_kw),
                                  PrecisionConfig(), topo)
    tokens, labels = batch()
    losses = []
    for _ in range(steps):
        engine.zero_grad()
        loss = model(tokens, labels).float().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        stores = [s for s in engine.stores if isinstance(s, Stage3Params)]
        held = [u.index for s in stores for u in s.units if u.full is not None
                and not u.persistent]
        assert not held, f"units {held} still gathered after the step (stale weights)"
    with torch.no_grad():
        engine_weights = {n: p.detach().clone() for n, p in _gathered(engine, model)}
    return losses, engine_weights


def _gathered(engine, model):
    for s in engine.stores:
        if isinstance(s, Stage3Params):
            s.gather_all()
    out = list(model.named_parameters())
    out = [(n, p.detach().clone()) for n, p in out]
    for s in engine.stores:
        if isinstance(s, Stage3Params):
            s.release_all()
    return out


@pytest.mark.parametrize("recompute", [
    RecomputeConfig(granularity="full", method="uniform"),
    RecomputeConfig(granularity="full", method="block", num_layers=3),
    RecomputeConfig(granularity="full", method="uniform", num_layers=3),
], ids=["uniform-1", "block-3", "uniform-3"])
def test_zero3_full_recompute_is_bitwise_zero3(recompute):
    ref_losses, ref_weights = _train(ZERO3, None)
    losses, weights = _train(ZERO3, recompute)
    assert losses == ref_losses
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name


def test_recomputation_prefetches_nothing_forward(monkeypatch):
    """Every gather in a recomputing backward is of a unit the backward still needs: as many
    gathers as without prefetching at all."""
    counts = {}
    for prefetch in (0, 10**9):
        n = [0]
        real = Stage3Params._gather

        def counting(self, u, async_op, real=real, n=n):
            if u.full is None and u.gather_handle is None:
                n[0] += 1
            real(self, u, async_op)

        monkeypatch.setattr(Stage3Params, "_gather", counting)
        _train({**ZERO3, "stage3_prefetch_bucket_size": prefetch,
                "stage3_max_reuse_distance": 0},
               RecomputeConfig(granularity="full", method="uniform"), steps=2)
        counts[prefetch] = n[0]
    assert counts[10**9] == counts[0], counts


def test_a_unit_gathered_at_the_step_is_not_carried_past_it():
    """Whatever left a unit gathered (a prefetch, gather_all), the step releases it: the next
    forward gathers the updated shard."""
    torch.manual_seed(0)
    topo = ParallelTopology.single()
    model = GPTModel(tiny_config("gpt2", num_layers=2), topo)
    engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-2), ZeroConfig(**ZERO3),
                                  PrecisionConfig(), topo)
    tokens, labels = batch()
    engine.backward(model(tokens, labels).float().mean())
    store = next(s for s in engine.stores if isinstance(s, Stage3Params))
    for u in store.units:
        store._ensure(u)
    engine.step()
    assert all(u.full is None for u in store.units if not u.persistent)
    store.gather_all()
    for u in store.units:
        assert torch.equal(u.full[u.own_lo:u.own_hi], u.shard)
