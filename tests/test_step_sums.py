"""The optimizer step's scalar sums handed over early (ZeroOptimizer.send_step_sums).

On 2 gloo ranks, at stage 0 with data parallelism only (every rank's gradient norm is its own:
the sums go out before the gradient wait, asynchronously) and at stage 1 (the norm is summed
over the shards: the sums wait for the step's blocking all-reduce):

* a non-finite loss on one rank only, with finite gradients everywhere, still skips the update
  on both ranks, and the sums come back summed over the ranks;
* a normal step gives the same norm and the same weights, bit for bit, as handing the same
  values to ``step()``;
* the breakdown shows where the collective went: launched early and waited at stage 0,
  blocking in the step at stage 1;
* handing the values twice is an error.
"""

import pytest

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.monitor import Timers
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, make_batches
from megazero.topology import ParallelTopology
from megazero.zero import build_zero_optimizer

VOCAB = 64


def _engine(stage):
    model = TinyLM(vocab=VOCAB, hidden=16, layers=2)
    engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-2, clip_grad=1.0),
                                  ZeroConfig(stage=stage, overlap_comm=True), PrecisionConfig(),
                                  ParallelTopology.build())
    return model, engine


def _sums_world(rank, world_size, stage):
    tokens, labels = make_batches(3, 2, 8, VOCAB, seed=rank)[0]
    out = {}
    model, engine = _engine(stage)
    timers = Timers()
    # a loss that is NaN on rank 1 only; the gradients stay finite
    engine.zero_grad()
    engine.backward(model(tokens, labels).mean())
    engine.send_step_sums(loss_is_finite=rank != 1, also_sum=[rank + 1.0, 10.0])
    engine.finish_grad_sync()
    r = engine.step(skip_nonfinite=True)
    out["skip"] = (r.updated, r.nonfinite, r.sums)
    # a normal step, early values against the same values given to step()
    results = []
    for early in (True, False):
        model, engine = _engine(stage)
        if early:
            engine.comms.set_timers(timers)
        engine.zero_grad()
        engine.backward(model(tokens, labels).mean())
        if early:
            engine.send_step_sums(also_sum=[2.0 * rank])
            with pytest.raises(ValueError, match="already given"):
                engine.step(also_sum=[1.0])  # refused before it does anything
            engine.finish_grad_sync()
            r = engine.step()
            out["regions"] = sorted(timers.pop_all())
        else:
            engine.finish_grad_sync()
            r = engine.step(also_sum=[2.0 * rank])
        results.append((r.updated, r.grad_norm, r.sums,
                        [p.detach().clone().numpy() for p in model.parameters()]))
    out["early"], out["late"] = results
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_early_step_sums_skip_sum_and_match_the_step(stage):
    for rank, o in enumerate(run_distributed(_sums_world, 2, stage, timeout=180)):
        assert o["skip"] == (False, True, (3.0, 20.0)), (rank, o["skip"])
        (up_a, norm_a, sums_a, w_a), (up_b, norm_b, sums_b, w_b) = o["early"], o["late"]
        assert up_a and up_b
        assert norm_a == norm_b and sums_a == sums_b == (2.0,)
        assert all((a == b).all() for a, b in zip(w_a, w_b))
        regions = o["regions"]
        if stage == 0:  # sent before the gradient wait, waited in the step
            assert "comm world/scalar launch" in regions and "comm world/scalar" not in regions
        else:  # summed with the shards' norm in the step's blocking all-reduce
            assert "comm world/scalar" in regions and "comm world/scalar launch" not in regions
