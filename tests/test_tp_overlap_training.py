"""--tp-comm-overlap trains the same model: through the training entry point (setup + train, as
``pretrain_gpt.py``), runs with the sequence-parallel collectives inside the GEMMs give the
one-process run's losses, grad norms and weights to fp32 rounding at tp 2 and 4, with context
parallel 2, interleaved pipeline parallel 2, a zero-bubble schedule (weight gradients deferred
to W), ZeRO 1 and 3, full recompute (the recomputed forward repeats the ring), and with the
per-part switches; and an MoE model with a shared expert at expert parallel 2 under
--moe-shared-expert-overlap.

Tolerance (megazero.testing.schedule_runs.assert_same_run): only the order of sums differs
(the ring reduce-scatter adds the ranks' partials starting from the next rank, the chunked
weight gradient sums chunk by chunk); a wrong chunk or a missing gradient moves a weight by a
whole Adam step.
"""

from megazero.testing import run_distributed
from megazero.testing.schedule_runs import assert_same_run, merge_ranks, runs_world
from megazero.testing.training_runs import TINY

BASE = [*TINY, "--train-iters", "2", "--untie-embeddings-and-output-weights"]
TP_SP = ["--sequence-parallel", "--tp-comm-overlap"]


def _tp(tp, *extra):
    return ["--tensor-model-parallel-size", str(tp), *TP_SP, *extra]


MOE = [*BASE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-shared-expert-intermediate-size", "32", "--moe-token-dispatcher-type", "alltoall",
       "--swiglu", "--disable-bias-linear"]

DENSE_LAYOUTS = [
    ("tp4 sp overlap", _tp(4)),
    ("tp2 sp overlap dp2 zero1", _tp(2, "--zero-stage", "1")),
    ("tp2 sp overlap dp2 zero3", _tp(2, "--zero-stage", "3")),
    ("tp2 sp overlap cp2", _tp(2, "--context-parallel-size", "2")),
    ("tp2 sp overlap pp2 interleaved", _tp(2, "--pipeline-model-parallel-size", "2",
                                           "--num-layers-per-virtual-pipeline-stage", "1")),
    ("tp2 sp overlap pp2 zb-h1 (deferred wgrad)", _tp(
        2, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1")),
    ("tp2 sp overlap dp2 full recompute", _tp(2, "--recompute-granularity", "full",
                                              "--recompute-method", "uniform",
                                              "--recompute-num-layers", "1")),
    ("tp2 sp overlap rs-dgrad, no ag", _tp(2, "--tp-comm-overlap-rs-dgrad",
                                           "--disable-tp-comm-overlap-ag")),
    ("tp2 sp overlap no bulk, no rs", _tp(2, "--disable-tp-comm-bulk-dgrad",
                                          "--disable-tp-comm-bulk-wgrad",
                                          "--disable-tp-comm-overlap-rs")),
]
# --moe-shared-expert-overlap (the shared expert under the dispatch all-to-all) at expert
# parallel 2, alone and with TP 2 + SP + --tp-comm-overlap
MOE_LAYOUTS = [
    ("ep2 dp4 shared-expert overlap", ["--expert-model-parallel-size", "2",
                                       "--moe-shared-expert-overlap"]),
    ("tp2 sp ep2 shared-expert overlap + tp overlap",
     ["--expert-model-parallel-size", "2", "--moe-shared-expert-overlap",
      "--expert-tensor-parallel-size", "1", *_tp(2)]),
]


def test_tp_and_shared_expert_overlap_train_the_one_process_model():
    """Every layout in one world of 4 against the one-process runs of the dense and the MoE
    model (one world of 1)."""
    dense, moe = merge_ranks(run_distributed(runs_world, 1, [BASE, MOE], timeout=300))
    cases = [BASE + a for _, a in DENSE_LAYOUTS] + [MOE + a for _, a in MOE_LAYOUTS]
    got = merge_ranks(run_distributed(runs_world, 4, cases, timeout=600))
    for (what, args), g in zip(DENSE_LAYOUTS, got):
        assert_same_run(g, dense, what, weights="3" not in args)
    (what0, _), (what1, _) = MOE_LAYOUTS
    g0, g1 = got[len(DENSE_LAYOUTS):]
    assert_same_run(g0, moe, what0)
    # weights come from TP rank 0 only, which at tp 2 x ep 2 holds half of the experts
    assert_same_run(g1, moe, what1, subset=True)
    assert len(g1["weights"]) > len(moe["weights"]) // 2
