"""``pretrain_gpt.py`` with MoE layers trains the same model at every layout: expert parallel
2 and 4, expert tensor parallel 2 (alone and with EP 2 x TP 2), both dispatchers, grouped
GEMM, TP2+SP, PP2 interleaved with a stage that holds no MoE layer, ZeRO 0-3 (at ZeRO 3 also
with the experts partitioned over an expert-data-parallel group apart from the data-parallel
one, with PP2 and with parameters offloaded to the host). Losses, grad norms and validation
loss (a function of every weight and expert bias) equal the one-process run to fp32 rounding.
The model drops tokens (capacity factor 1.0), routes by sigmoid with the aux-loss-free expert
bias, and has a gated shared expert, an aux loss and a z-loss, so every part of the router is
in the comparison."""

from __future__ import annotations

import json

import pytest

from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

LAYOUTS = [
    (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
         "--moe-grouped-gemm", "--zero-stage", "1", "--recompute-granularity", "full",
         "--recompute-method", "uniform"]),
    (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--zero-stage", "3"]),
    (8, ["--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--moe-token-dispatcher-type",
         "alltoall", "--zero-stage", "2", "--deepspeed_config", "OFFLOAD"]),
    (4, ["--expert-model-parallel-size", "4", "--zero-stage", "0"]),
    (2, ["--expert-tensor-parallel-size", "2", "--moe-grouped-gemm", "--zero-stage", "3",
         "--deepspeed_config", "ZERO3_SHARDED"]),
    (4, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
         "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--moe-token-dispatcher-type", "alltoall", "--zero-stage", "2"]),
    # ZeRO 3 with experts partitioned over edp = 2, dense weights over dp = 4 (EP != TP)
    (4, ["--expert-model-parallel-size", "2", "--zero-stage", "3", "--deepspeed_config",
         "PARAM_OFFLOAD"]),
    (4, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
         "--moe-grouped-gemm", "--zero-stage", "3", "--deepspeed_config", "ZERO3_SHARDED"]),
    (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--zero-stage", "3", "--recompute-granularity", "full", "--recompute-method",
         "uniform", "--deepspeed_config", "ZERO3_RELEASE"]),
    # experts replicated over TP too: edp 4, dp 2
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "3",
         "--deepspeed_config", "ZERO3_SHARDED"]),
]


MOE_SCALARS = ("load_balancing_loss", "z_loss", "moe/tokens_per_expert_min",
               "moe/tokens_per_expert_max", "moe/dropped_token_fraction")


def _validation(path) -> float:
    recs = [json.loads(x) for x in open(path, encoding="utf-8")]
    return [r for r in recs if "lm loss validation" in r][-1]["lm loss validation"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    ref = d / "ref.jsonl"
    out = check(run_training([*TINY, *MOE, "--log-json", str(ref), "--tensorboard-dir",
                              str(d / "tb"), "--moe-per-layer-logging"]))
    # the log line and TensorBoard carry the routers' scalars under Megatron's names
    assert "load_balancing_loss: " in out and "dropped tokens: " in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    for tag in (*MOE_SCALARS, "moe/load_balancing_loss_layer_0",
                "moe/load_balancing_loss_layer_2"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    assert "moe/load_balancing_loss_layer_1" not in acc.Tags()["scalars"]  # a dense layer
    return ref, _parameter_count(out)


def _parameter_count(out: str) -> str:
    """The banner's parameter count: every expert counted once, whatever the layout."""
    line = next(x for x in out.splitlines() if x.startswith("> model:"))
    return line[line.index("parameters ("):]


@pytest.mark.parametrize("nproc,layout", LAYOUTS, ids=[
    "ep2-a2a-grouped-z1-recompute", "tp2sp-ep2-z3", "tp2sp-pp2vpp-ep4-a2a-z2-offload", "ep4-z0",
    "etp2-grouped-z3", "tp2sp-ep2-etp2-a2a-z2",
    "ep2-edp2-z3-offload-param", "ep2-edp2-a2a-grouped-z3", "pp2-ep2-z3-recompute",
    "tp2sp-ep1-edp4-z3"])
def test_moe_layout_trains_the_one_process_model(reference, tmp_path, nproc, layout):
    reference, count = reference
    a = read_metrics(reference)
    assert len(a) == 4
    got = tmp_path / "got.jsonl"
    offload = tmp_path / "offload.json"  # optimizer state offloaded to the host
    offload.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {
        "device": "cpu"}}}))
    param_offload = tmp_path / "param_offload.json"  # stage-3 shards on the host, prefetched
    param_offload.write_text(json.dumps({"zero_optimization": {
        "offload_param": {"device": "cpu"}, "overlap_comm": True,
        "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 40,
        "stage3_prefetch_bucket_size": 3000, "reduce_bucket_size": 2000}}))
    # every unit partitioned (the default threshold keeps this tiny model's units whole), and
    # released after each forward, gathered again for the backward and its recomputation
    sharded, release = tmp_path / "sharded.json", tmp_path / "release.json"
    sharded.write_text(json.dumps({"zero_optimization": {
        "stage3_param_persistence_threshold": 0}}))
    release.write_text(json.dumps({"zero_optimization": {
        "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 2000, "stage3_max_live_parameters": 20000}}))
    files = {"OFFLOAD": str(offload), "PARAM_OFFLOAD": str(param_offload),
             "ZERO3_SHARDED": str(sharded), "ZERO3_RELEASE": str(release)}
    layout = [files.get(x, x) for x in layout]
    out = check(run_training([*TINY, *MOE, *layout, "--log-json", str(got)], nproc=nproc))
    assert _parameter_count(out) == count
    b = read_metrics(got)
    assert sorted(b) == sorted(a)
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), it
        for k in MOE_SCALARS:  # routing, dropping and the losses are layout-independent
            assert b[it][k] == pytest.approx(a[it][k], rel=1e-5, abs=1e-9), (it, k)
    assert a[4]["moe/dropped_token_fraction"] > 0  # the capacity factor drops tokens
    assert _validation(got) == pytest.approx(_validation(reference), rel=LOSS_RTOL)
