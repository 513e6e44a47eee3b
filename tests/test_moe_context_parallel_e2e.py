"""``pretrain_gpt.py`` with MoE layers and context parallelism trains the one-process model:
expert parallelism over the CP ranks of one sequence (CP 2 x EP 2, with PP 2 interleaved and a
stage without MoE layers), over CP and data replicas (CP 2 x DP 2 x EP 4), with its edp group
apart from dp x cp (CP 2 x DP 2 x EP 2), and with TP 2 + SP x CP 2 (EP 2, ZeRO 3); both
dispatchers; and with every expert split over CP 2 x DP 2's expert tensor group (ETP 2). The
model (megazero.testing.moe_runs)
drops tokens by position, routes by sigmoid with the expert bias, and has an aux loss, a
z-loss and a gated shared expert. Losses, grad norms, the MoE scalars, the validation loss and
the final weights and expert biases equal the one-process run to fp32 rounding."""

from __future__ import annotations

import pytest

from megazero.checkpoint.shard_reader import read_model_state
from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

# position drops depend on the tokens' sequence order, which the zigzag split permutes; a
# learning rate still above 0 at the last step makes the final weights tell. No linear biases:
# the key bias has no gradient in exact arithmetic (the softmax ignores a constant per query),
# and Adam turns its rounding noise into steps of the learning rate's size, different at each
# layout (a weight comparison to 2e-6 would be a comparison of noise).
RUN = [*TINY, *MOE, "--moe-token-drop-policy", "position", "--lr-decay-iters", "100",
       "--save-interval", "4", "--disable-bias-linear"]
CP2 = ["--context-parallel-size", "2"]
LAYOUTS = [
    (4, [*CP2, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
         "1", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
         "--zero-stage", "1"]),
    (4, [*CP2, "--expert-model-parallel-size", "2", "--zero-stage", "0",
         "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    (4, [*CP2, "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall",
         "--moe-grouped-gemm", "--zero-stage", "2", "--cp-comm-type", "all_gather"]),
    (4, [*CP2, "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-model-parallel-size", "2", "--zero-stage", "3"]),
    (4, [*CP2, "--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
         "--zero-stage", "1"]),
]
MOE_SCALARS = ("load_balancing_loss", "z_loss", "moe/tokens_per_expert_min",
               "moe/tokens_per_expert_max", "moe/dropped_token_fraction")


def _validation(path) -> float:
    import json

    recs = [json.loads(x) for x in open(path, encoding="utf-8")]
    return [r for r in recs if "lm loss validation" in r][-1]["lm loss validation"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_cp")
    check(run_training([*RUN, "--log-json", str(d / "ref.jsonl"), "--save", str(d / "ck")]))
    return d


@pytest.mark.parametrize("nproc,layout", LAYOUTS, ids=[
    "pp2vpp-cp2-ep2-a2a-z1", "cp2-dp2-ep2-z0-recompute", "cp2-dp2-ep4-a2a-grouped-z2-allgather-cp",
    "tp2sp-cp2-ep2-z3", "cp2-dp2-etp2-a2a-z1"])
def test_moe_with_context_parallelism_trains_the_one_process_model(reference, tmp_path,
                                                                   nproc, layout):
    got = tmp_path / "got.jsonl"
    check(run_training([*RUN, *layout, "--log-json", str(got), "--save", str(tmp_path / "ck")],
                       nproc=nproc))
    a, b = read_metrics(reference / "ref.jsonl"), read_metrics(got)
    assert sorted(b) == sorted(a) == [1, 2, 3, 4]
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), it
        for k in MOE_SCALARS:  # routing, dropping and the losses are layout-independent
            assert b[it][k] == pytest.approx(a[it][k], rel=1e-5, abs=1e-9), (it, k)
    assert min(a[it]["moe/dropped_token_fraction"] for it in a) > 0  # tokens are dropped
    assert _validation(got) == pytest.approx(_validation(reference / "ref.jsonl"),
                                             rel=LOSS_RTOL)
    _, want = read_model_state(str(reference / "ck"))
    _, have = read_model_state(str(tmp_path / "ck"))
    assert sorted(have) == sorted(want)
    biases = [n for n in want if n.endswith("router.expert_bias")]
    assert len(biases) == 2 and all(want[n].abs().max() > 0 for n in biases)
    for name, w in want.items():
        scale = max(w.abs().max().item(), 1.0)
        assert (have[name] - w).abs().max().item() <= 2e-6 * scale, name
