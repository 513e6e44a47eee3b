"""Zero-bubble schedules train the one-process model: ZB-H1, ZBV, DualPipeV and 1F1B with
delayed weight gradients at pp 2 and pp 4, through the training entry point (setup + train,
as ``pretrain_gpt.py``), give the single-process run's losses, grad norms and weights to fp32
rounding; also with TP 2 + sequence parallelism, context parallelism, ZeRO 1, 2 and 3, full
recompute, tied embeddings, uneven splits, fp16 loss scaling, an MoE model at expert parallel
2, a ZBV checkpoint resumed at 1F1B; ZBV in bf16, and delayed weight gradients at pp 2 with
TP 2 + SP.

Cost: starting a world and the first run in it dominate on a small machine, so every layout
runs in one world of 4 ranks (pp 2 layouts at data parallel 2) and every one-process reference
in one world of 1, each started once per module (fixtures); the tests only compare. Two
iterations each: the second one's loss and the weights after it see the first optimizer step,
which a wrong weight gradient has already spoilt. Four layers unless the layout needs more (a
V over 4 stages needs 8 chunks; the uneven splits share that model).

Tolerance: only the order of the sums differs (micro-batch accumulation, TP partial sums), so
losses and grad norms agree to ~1e-6 relative; weights after two Adam steps (lr 3e-3) to
2e-5 of their largest entry plus 3e-6 (a thousandth of a step: Adam's normalised update turns
rounding in a near-zero gradient into up to ~1e-7 of weight). A wrong or missing weight
gradient moves them by a whole step.
"""

import pytest

from megazero.testing import run_distributed
from megazero.testing.schedule_runs import runs_world
from megazero.testing.training_runs import TINY

UNTIE = "--untie-embeddings-and-output-weights"
DENSE = [*TINY, "--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
         UNTIE, "--train-iters", "2"]
#: the one-process runs every layout is compared with
REFS = {
    "dense": DENSE,
    "deep": [*DENSE, "--num-layers", "8"],  # pp 4 with a V: 2 x 4 chunks
    "moe": [*DENSE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
            "16", "--swiglu", "--disable-bias-linear"],
    "tied": [x for x in DENSE if x != UNTIE],
    "fp16": [*DENSE, "--fp16"],
    "bf16": [*DENSE, "--bf16"],
}


BF16_RTOL = 4e-3


def _pp(pp, *extra):
    return ["--pipeline-model-parallel-size", str(pp), *extra]


ZBV, ZBH1, DPV = (["--pipeline-schedule", s] for s in ("zbv", "zb-h1", "dualpipev"))


def cases(tmp):
    """(what, reference, layout flags) of every layout, all run in one world of 4 ranks (pp 2
    layouts with data parallel 2). ``tmp``: where the resume chains keep their checkpoints."""
    return [
        ("pp4 zb-h1", "deep", _pp(4, *ZBH1)),
        ("pp4 zbv", "deep", _pp(4, *ZBV)),
        ("pp4 dualpipev", "deep", _pp(4, "--pipeline-schedule", "DualPipeV")),
        ("pp4 1f1b delayed wgrad", "deep", _pp(4, "--delay-wgrad-compute")),
        ("pp2 tp2 sp zb-h1", "dense", _pp(2, *ZBH1, "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel")),
        ("pp2 tp2 sp zbv full recompute", "dense", _pp(
            2, *ZBV, "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1")),
        ("pp2 tp2 sp 1f1b delayed wgrad", "dense", _pp(
            2, "--delay-wgrad-compute", "--tensor-model-parallel-size", "2",
            "--sequence-parallel")),
        ("pp2 dp2 dualpipev zero1", "dense", _pp(2, *DPV, "--zero-stage", "1")),
        ("pp2 dp2 zbv zero3", "dense", _pp(2, *ZBV, "--zero-stage", "3")),
        ("pp2 dp2 zb-h1 zero3", "dense", _pp(2, *ZBH1, "--zero-stage", "3")),
        ("pp2 cp2 zbv", "dense", _pp(2, *ZBV, "--context-parallel-size", "2")),
        ("pp2 ep2 zbv", "moe", _pp(2, *ZBV, "--expert-model-parallel-size", "2")),
        ("pp2 ep2 zb-h1 grouped", "moe", _pp(2, *ZBH1, "--expert-model-parallel-size", "2",
                                             "--moe-grouped-gemm")),
        # 8 layers as 5 + 3 under 1F1B, and layout strings with the embedding and the loss on
        # stages of their own under interleaved 1F1B and ZBV (the --account-for-* flags and
        # the estimator's per-stage charges are checked without training, in
        # tests/test_zero_bubble_schedules.py and tests/test_planner_step_time.py)
        ("uneven: pp2 1f1b 5+3", "deep", _pp(2, "--decoder-first-pipeline-num-layers", "5")),
        ("uneven: pp2 interleaved E|t*5|t*3|L", "deep",
         _pp(2, "--pipeline-model-parallel-layout", "E|t*5|t*3|L")),
        ("uneven: pp2 zbv E|ttttt|ttt|L", "deep",
         _pp(2, "--pipeline-model-parallel-layout", "E|ttttt|ttt|L", *ZBV)),
        # the V holds the embedding and the output layer's copy on rank 0: their gradients are
        # summed there, at ZeRO 0, 1 and 3; ZB-H1 sums them over the embedding group as 1F1B
        ("pp2 zbv tied", "tied", _pp(2, *ZBV)),
        ("pp2 dualpipev tied zero1", "tied", _pp(2, *DPV, "--zero-stage", "1")),
        ("pp2 zbv tied zero3", "tied", _pp(2, *ZBV, "--zero-stage", "3")),
        ("pp2 zb-h1 tied zero2", "tied", _pp(2, *ZBH1, "--zero-stage", "2")),
        # fp16 with dynamic loss scaling (the overflow check and unscaling after the last W)
        ("pp2 zbv fp16", "fp16", _pp(2, *ZBV)),
        ("pp2 zb-h1 fp16 zero1", "fp16", _pp(2, *ZBH1, "--zero-stage", "1")),
        ("pp2 zbv bf16", "bf16", _pp(2, *ZBV)),
        # a ZBV checkpoint resumed at 1F1B, and a 1F1B one at ZBV: one iteration each side
        ("resume: zbv saves", "dense", _pp(2, *ZBV, "--train-iters", "1", "--save",
                                           f"{tmp}/zbv")),
        ("resume: 1f1b loads", "dense", _pp(2, "--load", f"{tmp}/zbv")),
        ("resume: 1f1b saves", "dense", _pp(2, "--train-iters", "1", "--save", f"{tmp}/1f1b")),
        ("resume: zbv loads", "dense", _pp(2, *ZBV, "--load", f"{tmp}/1f1b")),
    ]


def _merge(ranks):
    """Per case: rank 0's losses and norms, every rank's weights."""
    out = []
    for i, first in enumerate(ranks[0]):
        weights = {}
        for r in ranks:
            weights.update(r[i]["weights"])
        out.append({**first, "weights": weights})
    return out


@pytest.fixture(scope="module")
def refs():
    got = _merge(run_distributed(runs_world, 1, list(REFS.values()), timeout=300))
    return dict(zip(REFS, got))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    layouts = cases(tmp_path_factory.mktemp("resume"))
    got = _merge(run_distributed(runs_world, 4, [REFS[ref] + a for _, ref, a in layouts],
                                 timeout=600))
    return {what: (ref, args, g) for (what, ref, args), g in zip(layouts, got)}


def _zero3(args):
    return any(a == "--zero-stage" and b == "3" for a, b in zip(args, args[1:]))


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


def _family(world, refs, ref_names, prefix="", rtol=2e-6):
    """Compare every layout of ``world`` whose reference is in ``ref_names`` and whose name
    starts with ``prefix`` (the uneven splits and resume chains by name) with its reference."""
    chosen = [(what, c) for what, c in world.items() if c[0] in ref_names
              and what.startswith(prefix) and (prefix or ":" not in what)]
    assert chosen
    for what, (ref, args, got) in chosen:
        # ZeRO 3 partitions the parameters (no full weights to compare); fp16 weights differ
        # by more than fp32 rounding after the loss-scaled steps
        _compare(got, refs[ref], what, rtol=rtol, weights=rtol <= 2e-6 and not _zero3(args))


def test_zero_bubble_schedules_train_the_one_process_model_dense(refs, world):
    _family(world, refs, ["dense", "deep"])


def test_zero_bubble_schedules_train_the_one_process_model_moe_ep2(refs, world):
    _family(world, refs, ["moe"])


def test_uneven_splits_train_the_one_process_model(refs, world):
    _family(world, refs, ["deep"], prefix="uneven:")


def test_zero_bubble_schedules_with_tied_embeddings(refs, world):
    _family(world, refs, ["tied"])


def test_zero_bubble_schedules_with_fp16_loss_scaling(refs, world):
    """ZBV and ZB-H1 at pp 2 give the one-process fp16 run's losses and grad norms to fp16
    rounding of the summation order (1e-3)."""
    _family(world, refs, ["fp16"], rtol=1e-3)


def test_zero_bubble_schedule_in_bf16(refs, world):
    """ZBV at pp 2 (dp 2) in bf16 gives the one-process bf16 run's losses and grad norms to
    bf16 rounding of the summation order (bf16 keeps 8 bits: 2**-8 = 4e-3 per rounding; the
    loss and the main gradients are fp32, so on this machine they agree to ~1e-7). A skipped
    weight-gradient closure moves the grad norm by ~15%."""
    _family(world, refs, ["bf16"], rtol=BF16_RTOL)


def test_a_zbv_checkpoint_resumes_at_1f1b_and_back(refs, world):
    """ZBV trains one iteration and saves, 1F1B loads and trains the second; 1F1B saves
    after one and ZBV loads and trains the second: each chain's two losses and its weights
    are the one-process run's (the optimizer's state crossed the schedule change intact)."""
    ref = refs["dense"]
    for first, second in (("resume: zbv saves", "resume: 1f1b loads"),
                          ("resume: 1f1b saves", "resume: zbv loads")):
        a, b = world[first][2], world[second][2]
        assert len(a["losses"]) == len(b["losses"]) == 1, (first, second)
        _compare({**b, "losses": a["losses"] + b["losses"], "norms": a["norms"] + b["norms"]},
                 ref, f"{first} -> {second}")
