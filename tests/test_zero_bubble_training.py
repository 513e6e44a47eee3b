"""Zero-bubble schedules train the one-process model: ZB-H1, ZBV, DualPipeV and 1F1B with
delayed weight gradients at pp 2 and pp 4, through the training entry point (setup + train,
as ``pretrain_gpt.py``), give the single-process run's losses, grad norms and weights to fp32
rounding; also with TP 2 + sequence parallelism, context parallelism, ZeRO 1, 2 and 3, full
recompute, tied embeddings, uneven splits, and an MoE model at expert parallel 2.

Tolerance: only the order of the sums differs (micro-batch accumulation, TP partial sums), so
losses and grad norms agree to ~1e-6 relative; weights after two Adam steps (lr 3e-3) to
2e-5 of their largest entry plus 3e-6 (a thousandth of a step: Adam's normalised update turns
rounding in a near-zero gradient into up to ~1e-7 of weight). A wrong or missing weight
gradient moves them by a whole step.
"""

from megazero.testing import run_distributed
from megazero.testing.schedule_runs import runs_world
from megazero.testing.training_runs import TINY

ITERS = ["--train-iters", "2"]
DENSE = [*TINY, "--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--untie-embeddings-and-output-weights", *ITERS]
MOE = [*DENSE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--swiglu", "--disable-bias-linear"]


def _pp(pp, *extra):
    return ["--pipeline-model-parallel-size", str(pp), *extra]


def _compare(got, ref, what, weights=True, rtol=2e-6):
    assert len(got["losses"]) == len(ref["losses"]) == 2, what
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= rtol * abs(b), f"{what}: loss {a} vs {b}"
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= 10 * rtol * abs(b), f"{what}: grad norm {a} vs {b}"
    if weights:
        # a pipeline's copy of the tied embedding (the output layer's) is the embedding
        word = next((k for k in ref["weights"] if "word_embeddings" in k), None)
        alias = {"output_layer.weight": word} if "output_layer.weight" not in ref["weights"] \
            else {}
        assert {alias.get(k, k) for k in got["weights"]} == ref["weights"].keys(), what
        for k, w in got["weights"].items():
            r = ref["weights"][alias.get(k, k)]
            err = float(abs(w - r).max())
            assert err <= 2e-5 * float(abs(r).max()) + 3e-6, f"{what}: {k} off by {err}"


def _merge(ranks):
    """Per case: rank 0's losses and norms, every rank's weights."""
    out = []
    for i, first in enumerate(ranks[0]):
        weights = {}
        for r in ranks:
            weights.update(r[i]["weights"])
        out.append({**first, "weights": weights})
    return out


def _family(base, layouts, nproc, ref_world=1, rtol=2e-6):
    """The one-process run of ``base``, then every layout in one world of ``nproc``."""
    (ref,) = _merge(run_distributed(runs_world, ref_world, [base], timeout=300))
    got = _merge(run_distributed(runs_world, nproc, [base + a for _, a in layouts],
                                 timeout=600))
    for (what, args), g in zip(layouts, got):
        _compare(g, ref, what, rtol=rtol,
                 weights=rtol <= 2e-6 and ("--zero-stage" not in args or "3" not in args))
    return ref, got


def test_zero_bubble_schedules_train_the_one_process_model_dense():
    layouts = [
        ("pp4 zb-h1", _pp(4, "--pipeline-schedule", "zb-h1")),
        ("pp4 zbv", _pp(4, "--pipeline-schedule", "zbv")),
        ("pp4 dualpipev", _pp(4, "--pipeline-schedule", "DualPipeV")),
        ("pp4 1f1b delayed wgrad", _pp(4, "--delay-wgrad-compute")),
        ("pp2 tp2 sp zb-h1", _pp(2, "--pipeline-schedule", "zb-h1",
                                 "--tensor-model-parallel-size", "2", "--sequence-parallel")),
        ("pp2 tp2 sp zbv full recompute", _pp(
            2, "--pipeline-schedule", "zbv", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method",
            "uniform", "--recompute-num-layers", "1")),
        ("pp2 dp2 dualpipev zero1", _pp(2, "--pipeline-schedule", "dualpipev",
                                        "--zero-stage", "1")),
        ("pp2 dp2 zbv zero3", _pp(2, "--pipeline-schedule", "zbv", "--zero-stage", "3")),
        ("pp2 dp2 zb-h1 zero3", _pp(2, "--pipeline-schedule", "zb-h1", "--zero-stage", "3")),
        ("pp2 cp2 zbv", _pp(2, "--pipeline-schedule", "zbv", "--context-parallel-size", "2")),
    ]
    _family(DENSE, layouts, 4)


def test_zero_bubble_schedules_train_the_one_process_model_moe_ep2():
    layouts = [
        ("pp2 ep2 zbv", _pp(2, "--pipeline-schedule", "zbv",
                            "--expert-model-parallel-size", "2")),
        ("pp2 ep2 zb-h1 grouped", _pp(2, "--pipeline-schedule", "zb-h1",
                                      "--expert-model-parallel-size", "2",
                                      "--moe-grouped-gemm")),
    ]
    _family(MOE, layouts, 4)


UNEVEN = [*TINY, "--num-layers", "5", "--micro-batch-size", "1", "--global-batch-size", "8",
          "--untie-embeddings-and-output-weights", *ITERS]


def test_uneven_splits_train_the_one_process_model():
    """5 layers as 3 + 2 on pp 2 under 1F1B, and layout strings with the embedding and the
    loss on stages of their own under interleaved 1F1B and ZBV (the --account-for-* flags and
    the estimator's per-stage charges are checked without training, in
    tests/test_zero_bubble_schedules.py and tests/test_planner_step_time.py)."""
    layouts = [
        ("pp2 1f1b 3+2", _pp(2, "--decoder-first-pipeline-num-layers", "3")),
        ("pp2 interleaved E|t*3|t*2|L", _pp(2, "--pipeline-model-parallel-layout",
                                            "E|t*3|t*2|L")),
        ("pp2 zbv E|ttt|tt|L", _pp(2, "--pipeline-model-parallel-layout", "E|ttt|tt|L",
                                   "--pipeline-schedule", "zbv")),
    ]
    _family(UNEVEN, layouts, 2)


def _resume_world(rank, world, tmp):
    from megazero.testing.training_runs import train_in_rank

    base = [*DENSE[:-2], "--pipeline-model-parallel-size", "2"]
    zbv = ["--pipeline-schedule", "zbv"]
    straight = train_in_rank(rank, world, [*base, "--train-iters", "6"])
    first = train_in_rank(rank, world, [*base, *zbv, "--train-iters", "2", "--save",
                                        f"{tmp}/zbv"])
    second = train_in_rank(rank, world, [*base, "--train-iters", "4", "--load", f"{tmp}/zbv",
                                         "--save", f"{tmp}/1f1b"])
    third = train_in_rank(rank, world, [*base, *zbv, "--train-iters", "6", "--load",
                                        f"{tmp}/1f1b"])
    return straight, {**first, **second, **third}


def test_a_zbv_checkpoint_resumes_at_1f1b_and_back(tmp_path):
    """ZBV saves, 1F1B loads and saves, ZBV loads again: the six losses are the straight
    1F1B run's."""
    straight, resumed = run_distributed(_resume_world, 2, str(tmp_path), timeout=600)[0]
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    for it, loss in straight.items():
        assert abs(resumed[it] - loss) <= 2e-6 * abs(loss), (it, resumed[it], loss)


def test_zero_bubble_schedules_with_tied_embeddings():
    """The V holds the embedding and the output layer's copy on rank 0: their gradients are
    summed there, at ZeRO 0, 1 and 3; ZB-H1 sums them over the embedding group as 1F1B."""
    tied = [x for x in DENSE if x != "--untie-embeddings-and-output-weights"]
    layouts = [
        ("pp2 zbv tied", _pp(2, "--pipeline-schedule", "zbv")),
        ("pp2 dualpipev tied zero1", _pp(2, "--pipeline-schedule", "dualpipev",
                                         "--zero-stage", "1")),
        ("pp2 zbv tied zero3", _pp(2, "--pipeline-schedule", "zbv", "--zero-stage", "3")),
        ("pp2 zb-h1 tied zero2", _pp(2, "--pipeline-schedule", "zb-h1", "--zero-stage", "2")),
    ]
    _family(tied, layouts, 2)


def test_zero_bubble_schedules_with_fp16_loss_scaling():
    """fp16 with dynamic loss scaling (the overflow check and unscaling after the last W):
    ZBV and ZB-H1 at pp 2 give the one-process fp16 run's losses and grad norms to fp16
    rounding of the summation order (1e-3)."""
    layouts = [("pp2 zbv fp16", _pp(2, "--pipeline-schedule", "zbv")),
               ("pp2 zb-h1 fp16 zero1", _pp(2, "--pipeline-schedule", "zb-h1",
                                            "--zero-stage", "1"))]
    _family([*DENSE, "--fp16"], layouts, 2, rtol=1e-3)
