"""``pretrain_gpt.py``'s training with FP8 GEMMs trains the same model at every layout: each
run's losses, grad norms and validation loss equal the one-process FP8 run of its recipe.

Every scale is taken from the whole tensor (or the whole tile) whatever slice a rank holds, so
tp 2 + SP, pp 2, cp 2, ZeRO 1 and 3 and expert parallel 2 quantise the same values as one
process; what is left is fp32 accumulation order, which can flip an FP8 rounding now and then.
Cases share layouts: tensorwise at pp 2 x cp 2 with ZeRO 1 (the CP max-reduce), blockwise at
tp 2 + SP x dp 2 with ZeRO 3 (128-wide tiles of a 32-wide row split between TP ranks), and an
MoE model at expert parallel 2 (experts scaled per token row).

Starting processes is what costs on a small CI machine, so the runs share three spawned worlds,
one per world size (1, 2 and 4 ranks), each training its command lines one after another
(set up and trained as ``pretrain_gpt.py`` does, :func:`train_in_rank`); the one-process world
runs first, since the resumes read its checkpoint. What ``pretrain_gpt.py`` prints (the banner,
the load line) is captured per run on rank 0, and the comms logger's table is read off the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest

from megazero.testing.distributed import preload, run_distributed
from megazero.testing.launch import TINY, read_metrics
from megazero.testing.moe_runs import MOE

# the ranks' slow imports, paid once by the forkserver rather than by every rank of every world
preload("megazero.config", "megazero.training.lifecycle", "megazero.training.loop")

FP8 = ["--fp8-format", "hybrid", "--train-iters", "4", "--eval-interval", "4"]
# FP8 GEMMs on fp32 operands: the layouts agree to fp32 rounding of differently ordered sums,
# and such a difference moves an FP8 value only where it sits on a rounding boundary: a rare
# flip of one e4m3 step (6-12%) in one element. Observed over 4 iterations: losses <= 2e-5
# apart, grad norms <= 1.2e-4. A scale taken over a rank's slice instead of the whole tensor
# re-rounds every element of it: 1.1e-3 and 1.3e-3 on the grad norm at the first iteration
# (the CP max-reduce, the TP tile max-reduce left out on purpose), so the bounds below tell
# the two apart; the amaxes of the first iteration (before any update) must agree to fp32
# rounding outright.
FP8_RTOL = 5e-5
GRAD_RTOL = 5e-4
# bf16 parameters at dp 2 against one process (see the ZeRO 1-2 gather test)
BF16_RTOL = 1.5e-4
AMAX = ["--log-fp8-amax", "decoder.layers.*"]

CASES = {
    "tensorwise-pp2-cp2-z1": ("tensorwise", False, 4, [
        "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
        "--zero-stage", "1"]),
    "blockwise-tp2sp-dp2-z3": ("blockwise", False, 4, [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "3",
        "--deepspeed_config", "SHARDED"]),
    "moe-tensorwise-ep2-a2a-z1": ("tensorwise", True, 2, [
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
        "--moe-grouped-gemm", "--zero-stage", "1"]),
}

DELAYED = [*TINY, *FP8, "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
           "--fp8-amax-compute-algo", "max", "--fp8-margin", "1", "--lr-decay-iters", "4"]
DELAYED_TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]


def _train_jobs(rank, world, jobs):
    """Train each job's command line in turn in this world. A job is ``(name, args, latest)``;
    ``latest`` ``(dir, iteration)`` points ``dir``'s tracker at that iteration first (a resume
    from an earlier save of a run this world made). Rank 0 returns, by name, what the run
    printed and the comms logger's table (or None)."""
    from megazero.testing.training_runs import train_in_rank

    out = {}
    for name, args, latest in jobs:
        if latest is not None and rank == 0:
            with open(os.path.join(latest[0], "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(latest[1]))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            _, run = train_in_rank(rank, world, args, keep_run=True)
        comms = run.comms_logger.summary() if run.comms_logger is not None else None
        out[name] = printed.getvalue(), comms
        del run
    return out if rank == 0 else None


class Runs:
    """The runs of every test in this file, by world size; ``metrics(name)`` and
    ``validation(name)`` read a run's ``--log-json``, ``printed(name)`` its output."""

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.jobs: dict[int, list] = {1: [], 2: [], 4: []}
        self.out: dict[str, tuple[str, str | None]] = {}

    def add(self, world: int, name: str, args: list[str], latest=None) -> None:
        self.jobs[world].append((name, [*args, "--log-json", self.log(name)], latest))

    def log(self, name: str) -> str:
        return str(self.tmp / f"{name}.jsonl")

    def run(self) -> Runs:
        for world in (1, 2, 4):  # the one-process world first: the resumes read its saves
            if self.jobs[world]:
                self.out.update(run_distributed(_train_jobs, world, self.jobs[world],
                                                timeout=600)[0])
        return self

    def metrics(self, name: str) -> dict[int, dict]:
        return read_metrics(self.log(name))

    def validation(self, name: str) -> float:
        recs = [json.loads(x) for x in open(self.log(name), encoding="utf-8")]
        return [r for r in recs if "lm loss validation" in r][-1]["lm loss validation"]

    def printed(self, name: str) -> str:
        return self.out[name][0]

    def comms(self, name: str) -> str:
        table = self.out[name][1]
        assert table is not None, name
        return table


def _args(recipe: str, moe: bool) -> list[str]:
    return [*TINY, *(MOE if moe else []), *FP8, "--fp8-recipe", recipe,
            *(AMAX if recipe == "tensorwise" else [])]


def _ref(recipe: str, moe: bool) -> str:
    return f"ref-{recipe}{'-moe' if moe else ''}"


def _gather_base(tmp) -> list[str]:
    """bf16, ZeRO-3 over every data-parallel rank, every unit partitioned, no biases, the
    comms logger on, --fp8-param-gather."""
    ds = tmp / "ds-z3.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}, "comms_logger": {"enabled": True}}))
    return [*TINY, *FP8, "--fp8-recipe", "tensorwise", "--bf16", "--disable-bias-linear",
            "--ffn-hidden-size", "96", "--deepspeed_config", str(ds), "--fp8-param-gather"]


# ZeRO-1 with current scaling, ZeRO-2 with delayed scaling (Megatron's Llama-3 FP8 recipe:
# the distributed optimizer, delayed scaling, --fp8-param-gather)
Z12_GATHERS = ((1, "tensorwise"), (2, "delayed"))


def _gather_z12(tmp, stage: int, recipe: str) -> list[str]:
    """bf16 at ZeRO ``stage`` (1 or 2) with the comms logger, no biases, --fp8-param-gather."""
    ds = tmp / f"ds-z{stage}.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": stage},
                              "comms_logger": {"enabled": True}}))
    delayed = ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    return [*TINY, *FP8, "--fp8-recipe", recipe, *(delayed if recipe == "delayed" else []),
            "--bf16", "--disable-bias-linear", "--ffn-hidden-size", "96", "--deepspeed_config",
            str(ds), "--fp8-param-gather"]


# the distributed optimizer's FP8 gathers with experts: theirs over the expert-data-parallel
# group (of one rank at ep 2 x dp 2), the dense weights over dp 2
GATHER_MOE = [*TINY, *MOE, *FP8, "--fp8-recipe", "tensorwise", "--bf16",
              "--disable-bias-linear", "--use-distributed-optimizer", "--fp8-param-gather"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("fp8")
    r = Runs(tmp)
    # the layouts against the one-process run of their recipe
    for recipe, moe in sorted({(rc, m) for rc, m, _, _ in CASES.values()}):
        r.add(1, _ref(recipe, moe), _args(recipe, moe))
    sharded = tmp / "sharded.json"  # every ZeRO-3 unit partitioned
    sharded.write_text(json.dumps({"zero_optimization": {
        "stage3_param_persistence_threshold": 0}}))
    for case, (recipe, moe, nproc, layout) in CASES.items():
        layout = [str(sharded) if x == "SHARDED" else x for x in layout]
        r.add(nproc, case, [*_args(recipe, moe), *layout])
    # delayed scaling: straight with saves at 2 and 4, then resumed from 2 at two layouts
    save = str(tmp / "ck")
    r.add(1, "delayed-straight", [*DELAYED, "--save", save, "--save-interval", "2",
                                  "--log-fp8-amax", "decoder.layers.3.mlp.*"])
    r.add(1, "delayed-resumed-1", [*DELAYED, "--load", save], latest=(save, 2))
    r.add(4, "delayed-resumed-4", [*DELAYED, *DELAYED_TP2, "--load", save])
    # --fp8-param-gather at ZeRO-3, and at ZeRO 1-2 (against the bf16 gather of ZeRO-1)
    r.add(1, "gather-z3-ref", _gather_base(tmp))
    r.add(2, "gather-z3-dp2", _gather_base(tmp))
    zsave = str(tmp / "ck-z2")
    for stage, recipe in Z12_GATHERS:
        saves = ["--save", zsave, "--save-interval", "2"] if stage == 2 else []
        r.add(1, f"gather-z{stage}-{recipe}-ref", [*_gather_z12(tmp, stage, recipe), *saves])
        r.add(2, f"gather-z{stage}-{recipe}-dp2", _gather_z12(tmp, stage, recipe))
    r.add(2, "bf16-gather-z1-dp2", [x for x in _gather_z12(tmp, 1, "tensorwise")
                                    if x != "--fp8-param-gather"])
    r.add(1, "gather-z2-delayed-resumed", [*_gather_z12(tmp, 2, "delayed"), "--load", zsave],
          latest=(zsave, 2))
    r.add(1, "gather-moe-ref", GATHER_MOE)
    r.add(2, "gather-moe-ep2", [*GATHER_MOE, "--expert-model-parallel-size", "2",
                                "--moe-token-dispatcher-type", "alltoall"])
    return r.run()


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layout_trains_the_one_process_fp8_model(runs, case):
    recipe, moe, _, _ = CASES[case]
    ref = _ref(recipe, moe)
    assert "> fp8: hybrid format, " + recipe in runs.printed(ref)
    a, b = runs.metrics(ref), runs.metrics(case)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=FP8_RTOL), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=GRAD_RTOL), it
    assert runs.validation(case) == pytest.approx(runs.validation(ref), rel=FP8_RTOL)
    amax = {k: v for k, v in a[1].items() if k.startswith("fp8-amax/")}
    if recipe == "tensorwise":  # every dense linear's x, w and dy (the last rank's, logged)
        assert len(amax) == 4 * 4 * 3, sorted(amax)
        for k, v in amax.items():
            if k.endswith(".dy"):  # a CP rank's loss gradient is cp x its share: a power of
                ratio = math.log2(b[1][k] / v)  # two, which moves the scale, not the values
                assert abs(ratio - round(ratio)) < 1e-6, (k, b[1][k], v)
            else:
                assert b[1][k] == pytest.approx(v, rel=1e-6), k


def test_delayed_scaling_resumes_bitwise_and_at_another_layout(runs):
    """The amax history is in the checkpoint under each tensor's global name: a resume at
    iteration 2 continues the straight run bitwise, and at tp 2 + SP x dp 2 (another layout,
    its own pipeline of reductions) to rounding."""
    import torch

    save = runs.tmp / "ck"
    hist = torch.load(save / "iter_0000002" / "extra_state.pt", weights_only=True)
    hist = hist["fp8_amax_history"]
    name = "decoder.layers.3.mlp.linear_fc2.dy"
    assert len(hist) == 4 * 4 * 3 and hist[name].shape == (4,)
    assert (hist[name][:2] > 0).all() and (hist[name][2:] == 0).all()  # two steps recorded
    a = runs.metrics("delayed-straight")
    # --log-fp8-amax: the chosen tensors' newest amax, the history's head at that iteration
    logged = {k for k in a[2] if k.startswith("fp8-amax/")}
    assert logged == {f"fp8-amax/decoder.layers.3.mlp.linear_fc{i}.{r}" for i in (1, 2)
                      for r in ("x", "w", "dy")}
    assert a[2][f"fp8-amax/{name}"] == pytest.approx(float(hist[name][0]), rel=1e-7)
    for run, exact in (("delayed-resumed-1", True), ("delayed-resumed-4", False)):
        out = runs.printed(run)
        assert "loaded checkpoint" in out and "no FP8 amax history" not in out
        b = runs.metrics(run)
        assert sorted(b) == [3, 4]
        for it in (3, 4):
            if exact:
                assert b[it]["lm loss"] == a[it]["lm loss"], it
                assert b[it]["grad-norm"] == a[it]["grad-norm"], it
            else:
                assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=FP8_RTOL), it


def _gathers(table: str) -> dict[float, int]:
    """The comms logger's all-gather rows (through the backend or, ZeRO 1-2 on one host, in
    shared memory): message size in bytes -> count."""
    rows, op = {}, None
    units = {"B": 1, "KB": 1024, "MB": 1024 ** 2}
    for line in table.splitlines()[1:]:
        if line and not line.startswith(" "):
            op = line.strip()
        elif op and "all_gather" in op and line.strip():
            size, unit, count = line.split()[:3]
            rows[float(size) * units[unit]] = rows.get(float(size) * units[unit], 0) + int(count)
    return rows


def test_fp8_param_gather_halves_the_zero3_weight_gathers_at_equal_losses(runs):
    """bf16, ZeRO-3 over dp 2, every unit partitioned, no biases: with --fp8-param-gather the
    linears' weights (QKV and MLP 96 x 32, 6 KB in bf16; projection 32 x 32, 2 KB) travel as
    3 KB and 1 KB, everything else (norms 128 B, positions 1 KB, embedding 8 KB) as in bf16;
    and the losses are the one-process run's with the same flag (bitwise, as observed)."""
    assert "> --fp8-param-gather: 16 ZeRO-3 units" in runs.printed("gather-z3-dp2")
    got = _gathers(runs.comms("gather-z3-dp2"))
    # per gather of the model: 4 layers x (QKV, fc1, fc2) at 3 KB and (projection) at 1 KB,
    # 9 norm units of 128 B, the position table 1 KB, the word embedding 8 KB
    per_pass = {3072: 12, 1024: 4 + 1, 128: 9, 8192: 1}
    passes = got[8192]
    assert got == {k: v * passes for k, v in per_pass.items()}, got
    bf16 = {6144: 12 * passes, 2048: 4 * passes, 1024: passes, 128: 9 * passes, 8192: passes}
    total = {k: sum(s * c for s, c in v.items()) for k, v in (("bf16", bf16), ("fp8", got))}
    weights = {k: sum(s * c for s, c in v.items() if s in w) for k, v, w in (
        ("bf16", bf16, (6144, 2048)), ("fp8", got, (3072,)))}
    assert weights["fp8"] + 4 * passes * 1024 == weights["bf16"] / 2
    assert total["fp8"] < 0.6 * total["bf16"]
    ref, got_losses = runs.metrics("gather-z3-ref"), runs.metrics("gather-z3-dp2")
    assert sorted(ref) == sorted(got_losses) == [1, 2, 3, 4]
    for it in ref:
        assert got_losses[it]["lm loss"] == pytest.approx(ref[it]["lm loss"], rel=FP8_RTOL)


@pytest.mark.parametrize("stage,recipe", Z12_GATHERS)
def test_fp8_param_gather_at_zero_1_2_halves_the_weights_at_equal_losses(runs, stage, recipe):
    """ZeRO 1-2 over dp 2, bf16, no biases: after each step the FP8 GEMM weights (4 layers x
    QKV and MLP 96 x 32 x 3, projection 32 x 32: 40,960 elements) are gathered in a bucket of
    their own as one byte each, 40 KB where the bf16 gather moves 80 KB, and the rest of the
    model in bf16 as before.

    Every rank computes with the decoded weights, as the one-process run with the flag does.
    Adam's first step is the sign of the gradient to rounding, so both hold the same masters
    after it and the second iteration's loss is that run's bitwise, under delayed scaling too
    (where a one-process run that kept its 16-bit weights instead of their e4m3 round trip
    is 1e-5 off at once); later, bf16 gradients summed in another order move the masters by
    fp32 rounding, and the FP8 GEMMs amplify that (observed <= 7.9e-5 on the loss with the
    flag, <= 3.3e-5 without it). Under current scaling the gather is lossless: the losses are
    those of ZeRO-3's FP8 gather at the same layout, bitwise."""
    name = f"gather-z{stage}-{recipe}"
    assert "> --fp8-param-gather: 16 FP8 GEMM weights" in runs.printed(f"{name}-dp2")
    got = _gathers(runs.comms(f"{name}-dp2"))
    bf16 = _gathers(runs.comms("bf16-gather-z1-dp2"))
    (whole, passes), = bf16.items()  # one bucket, gathered after each of the 4 steps
    assert passes == 4
    weights = 40960
    assert sorted(got.values()) == [passes, passes] and got.get(weights) == passes, got
    rest, = (size for size in got if size != weights)  # the table prints sizes to 0.01 KB
    assert rest == pytest.approx(whole - 2 * weights, abs=0.01 * 1024), (got, bf16)
    ref, dp2 = runs.metrics(f"{name}-ref"), runs.metrics(f"{name}-dp2")
    assert sorted(ref) == sorted(dp2) == [1, 2, 3, 4]
    for it in (1, 2):
        assert dp2[it]["lm loss"] == ref[it]["lm loss"], it
    for it in (3, 4):
        assert dp2[it]["lm loss"] == pytest.approx(ref[it]["lm loss"], rel=BF16_RTOL), it
    if recipe == "tensorwise":
        z3 = runs.metrics("gather-z3-dp2")
        assert [dp2[it]["lm loss"] for it in dp2] == [z3[it]["lm loss"] for it in z3]


def test_fp8_param_gather_with_the_distributed_optimizer_and_experts(runs):
    """MoE layers 0 and 2 (4 experts, a shared expert), ZeRO-1 at expert parallel 2: each rank
    gathers its FP8 GEMM weights (dense layers: QKV, projection, fc1, fc2; MoE layers: QKV,
    projection, the shared expert's two and its 2 experts' two each: 24; one process: 32) as
    e4m3, and trains the one-process run's model."""
    assert "> --fp8-param-gather: 32 FP8 GEMM weights" in runs.printed("gather-moe-ref")
    assert "> --fp8-param-gather: 24 FP8 GEMM weights" in runs.printed("gather-moe-ep2")
    ref, ep2 = runs.metrics("gather-moe-ref"), runs.metrics("gather-moe-ep2")
    assert sorted(ref) == sorted(ep2) == [1, 2, 3, 4]
    for it in (1, 2):  # as in the ZeRO 1-2 test: bitwise until bf16 rounding accumulates
        assert ep2[it]["lm loss"] == ref[it]["lm loss"], it
    for it in (3, 4):  # observed <= 2.5e-5 apart
        assert ep2[it]["lm loss"] == pytest.approx(ref[it]["lm loss"], rel=BF16_RTOL), it


def test_fp8_param_gather_at_zero_2_resumes_bitwise_saving_only_the_amax_history(runs):
    """The decoded FP8 weights are a compute copy: the checkpoint holds the fp32 masters and,
    of FP8 state, only the delayed-scaling history; a resume at iteration 2 decodes the
    gathered weights from the masters again and continues the straight run bitwise."""
    import torch

    extra = torch.load(runs.tmp / "ck-z2" / "iter_0000002" / "extra_state.pt",
                       weights_only=True)
    assert [k for k in extra if "fp8" in k] == ["fp8_amax_history"]
    assert len(extra["fp8_amax_history"]) == 4 * 4 * 3
    assert "loaded checkpoint" in runs.printed("gather-z2-delayed-resumed")
    a, b = runs.metrics("gather-z2-delayed-ref"), runs.metrics("gather-z2-delayed-resumed")
    assert sorted(b) == [3, 4]
    for it in (3, 4):
        assert (b[it]["lm loss"], b[it]["grad-norm"]) == (a[it]["lm loss"], a[it]["grad-norm"])
