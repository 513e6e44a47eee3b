"""``pretrain_gpt.py`` with FP8 GEMMs trains the same model at every layout: each run's
losses, grad norms and validation loss equal the one-process FP8 run of its recipe.

Every scale is taken from the whole tensor (or the whole tile) whatever slice a rank holds, so
tp 2 + SP, pp 2, cp 2, ZeRO 1 and 3 and expert parallel 2 quantise the same values as one
process; what is left is fp32 accumulation order, which can flip an FP8 rounding now and then.
Cases share worlds: tensorwise at pp 2 x cp 2 with ZeRO 1 (the CP max-reduce), blockwise at
tp 2 + SP x dp 2 with ZeRO 3 (128-wide tiles of a 32-wide row split between TP ranks), and an
MoE model at expert parallel 2 (experts scaled per token row)."""

from __future__ import annotations

import json
import math

import pytest

from megazero.testing.launch import TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

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


def _validation(path) -> float:
    recs = [json.loads(x) for x in open(path, encoding="utf-8")]
    return [r for r in recs if "lm loss validation" in r][-1]["lm loss validation"]


def _args(recipe: str, moe: bool) -> list[str]:
    return [*TINY, *(MOE if moe else []), *FP8, "--fp8-recipe", recipe,
            *(AMAX if recipe == "tensorwise" else [])]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    refs = {}
    for recipe, moe in {(r, m) for r, m, _, _ in CASES.values()}:
        path = d / f"{recipe}-{moe}.jsonl"
        out = check(run_training([*_args(recipe, moe), "--log-json", str(path)]))
        refs[recipe, moe] = path, out
    return refs


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layout_trains_the_one_process_fp8_model(references, tmp_path, case):
    recipe, moe, nproc, layout = CASES[case]
    ref, ref_out = references[recipe, moe]
    assert "> fp8: hybrid format, " + recipe in ref_out
    sharded = tmp_path / "sharded.json"  # every ZeRO-3 unit partitioned
    sharded.write_text(json.dumps({"zero_optimization": {
        "stage3_param_persistence_threshold": 0}}))
    layout = [str(sharded) if x == "SHARDED" else x for x in layout]
    got = tmp_path / "got.jsonl"
    check(run_training([*_args(recipe, moe), *layout, "--log-json", str(got)], nproc=nproc))
    a, b = read_metrics(ref), read_metrics(got)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=FP8_RTOL), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=GRAD_RTOL), it
    assert _validation(got) == pytest.approx(_validation(ref), rel=FP8_RTOL)
    amax = {k: v for k, v in a[1].items() if k.startswith("fp8-amax/")}
    if recipe == "tensorwise":  # every dense linear's x, w and dy (the last rank's, logged)
        assert len(amax) == 4 * 4 * 3, sorted(amax)
        for k, v in amax.items():
            if k.endswith(".dy"):  # a CP rank's loss gradient is cp x its share: a power of
                ratio = math.log2(b[1][k] / v)  # two, which moves the scale, not the values
                assert abs(ratio - round(ratio)) < 1e-6, (k, b[1][k], v)
            else:
                assert b[1][k] == pytest.approx(v, rel=1e-6), k


DELAYED = [*TINY, *FP8, "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
           "--fp8-amax-compute-algo", "max", "--fp8-margin", "1", "--lr-decay-iters", "4"]


def test_delayed_scaling_resumes_bitwise_and_at_another_layout(tmp_path):
    """The amax history is in the checkpoint under each tensor's global name: a resume at
    iteration 2 continues the straight run bitwise, and at tp 2 + SP x dp 2 (another layout,
    its own pipeline of reductions) to rounding."""
    save = tmp_path / "ck"
    straight = tmp_path / "straight.jsonl"
    check(run_training([*DELAYED, "--save", str(save), "--save-interval", "2", "--log-json",
                        str(straight), "--log-fp8-amax", "decoder.layers.3.mlp.*"]))
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    import torch

    hist = torch.load(save / "iter_0000002" / "extra_state.pt", weights_only=True)
    hist = hist["fp8_amax_history"]
    name = "decoder.layers.3.mlp.linear_fc2.dy"
    assert len(hist) == 4 * 4 * 3 and hist[name].shape == (4,)
    assert (hist[name][:2] > 0).all() and (hist[name][2:] == 0).all()  # two steps recorded
    a = read_metrics(straight)
    # --log-fp8-amax: the chosen tensors' newest amax, the history's head at that iteration
    logged = {k for k in a[2] if k.startswith("fp8-amax/")}
    assert logged == {f"fp8-amax/decoder.layers.3.mlp.linear_fc{i}.{r}" for i in (1, 2)
                      for r in ("x", "w", "dy")}
    assert a[2][f"fp8-amax/{name}"] == pytest.approx(float(hist[name][0]), rel=1e-7)
    for nproc, layout, exact in ((1, [], True), (4, ["--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel", "--zero-stage",
                                                     "1"], False)):
        got = tmp_path / f"resumed{nproc}.jsonl"
        out = check(run_training([*DELAYED, *layout, "--load", str(save), "--log-json",
                                  str(got)], nproc=nproc))
        assert "loaded checkpoint" in out and "no FP8 amax history" not in out
        b = read_metrics(got)
        assert sorted(b) == [3, 4]
        for it in (3, 4):
            if exact:
                assert b[it]["lm loss"] == a[it]["lm loss"], it
                assert b[it]["grad-norm"] == a[it]["grad-norm"], it
            else:
                assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=FP8_RTOL), it


def _gathers(out: str) -> dict[float, int]:
    """The comms logger's all-gather rows: message size in bytes -> count."""
    table = out[out.index("communication summary"):].splitlines()[2:]
    rows, op = {}, None
    units = {"B": 1, "KB": 1024, "MB": 1024 ** 2}
    for line in table:
        if line and not line.startswith(" "):
            op = line.strip()
        elif op and op.startswith("all_gather") and line.strip():
            size, unit, count = line.split()[:3]
            rows[float(size) * units[unit]] = rows.get(float(size) * units[unit], 0) + int(count)
    return rows


def test_fp8_param_gather_halves_the_zero3_weight_gathers_at_equal_losses(tmp_path):
    """bf16, ZeRO-3 over dp 2, every unit partitioned, no biases: with --fp8-param-gather the
    linears' weights (QKV and MLP 96 x 32, 6 KB in bf16; projection 32 x 32, 2 KB) travel as
    3 KB and 1 KB, everything else (norms 128 B, positions 1 KB, embedding 8 KB) as in bf16;
    and the losses are the one-process run's with the same flag (bitwise, as observed)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}, "comms_logger": {"enabled": True}}))
    base = [*TINY, *FP8, "--fp8-recipe", "tensorwise", "--bf16", "--disable-bias-linear",
            "--ffn-hidden-size", "96", "--deepspeed_config", str(ds), "--fp8-param-gather"]
    runs = {}
    for name, nproc in (("ref", 1), ("dp2", 2)):
        path = tmp_path / f"{name}.jsonl"
        out = check(run_training([*base, "--log-json", str(path)], nproc=nproc))
        runs[name] = read_metrics(path), out
    out = runs["dp2"][1]
    assert "> --fp8-param-gather: 16 ZeRO-3 units" in out
    got = _gathers(out)
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
    ref = runs["ref"][0]
    for it in ref:
        assert runs["dp2"][0][it]["lm loss"] == pytest.approx(ref[it]["lm loss"], rel=FP8_RTOL)
