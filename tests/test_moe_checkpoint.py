"""An MoE checkpoint saved at EP 2 x TP 2 (SP, ZeRO 1) holds every expert once under its global
name, with the expert biases; it loads at EP 1 (one process) and EP 4 (ZeRO 2) and continues
with the uninterrupted one-process run's losses. A checkpoint saved at EP 2 with ZeRO 3 (experts
partitioned over their expert-data-parallel group, dense weights over dp) loads at EP 1 with
ZeRO 1, and the reverse, and continues with the same losses (the ZeRO-3 run keeps its
parameter shards in NVMe swap files)."""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

SAVE = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-model-parallel-size", "2", "--zero-stage", "1"]


# edp 2, dp 4; the stage-3 shards in NVMe swap files (saved from them, loaded into them)
EP2_ZERO3 = ["--expert-model-parallel-size", "2", "--zero-stage", "3", "--deepspeed_config",
             "NVME"]
EP1_ZERO1 = ["--zero-stage", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = tmp_path_factory.mktemp("moe_ck") / "ref.jsonl"
    check(run_training([*TINY, *MOE, "--log-json", str(ref)]))
    return ref


def _expert_names(ck) -> set[str]:
    index = json.load(open(os.path.join(ck, "iter_0000002", "metadata.json"), encoding="utf-8"))
    return set(index["tensors"])


def test_moe_checkpoint_reshards_over_expert_parallel_sizes(tmp_path, reference):
    ref = reference
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *SAVE, "--save", str(ck), "--exit-interval", "2"],
                       nproc=4))
    names = _expert_names(ck)
    for layer in (0, 2):
        for e in range(4):
            assert f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight" \
                in names
        assert f"decoder.layers.{layer}.mlp.router.expert_bias" in names
    a = read_metrics(ref)
    for nproc, layout in ((1, []), (4, ["--expert-model-parallel-size", "4", "--zero-stage",
                                        "2"])):
        got = tmp_path / f"resumed{nproc}.jsonl"
        check(run_training([*TINY, *MOE, *layout, "--load", str(ck), "--log-json", str(got)],
                           nproc=nproc))
        b = read_metrics(got)
        assert sorted(b) == [3, 4]
        for it in (3, 4):
            assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), (nproc, it)
            assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), (nproc, it)


@pytest.mark.parametrize("save,load", [((4, EP2_ZERO3), (2, EP1_ZERO1)),
                                       ((2, EP1_ZERO1), (4, EP2_ZERO3))],
                         ids=["ep2-zero3-to-ep1-zero1", "ep1-zero1-to-ep2-zero3"])
def test_moe_checkpoint_moves_between_zero3_over_edp_and_zero1(tmp_path, reference, save, load):
    nvme = tmp_path / "nvme.json"
    (tmp_path / "swap").mkdir()
    nvme.write_text(json.dumps({"zero_optimization": {"offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_count": 8,
        "buffer_size": 4096, "max_in_cpu": 0}, "stage3_param_persistence_threshold": 0}}))
    save = (save[0], [str(nvme) if x == "NVME" else x for x in save[1]])
    load = (load[0], [str(nvme) if x == "NVME" else x for x in load[1]])
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *save[1], "--save", str(ck), "--exit-interval", "2"],
                       nproc=save[0]))
    names = _expert_names(ck)
    for e in range(4):  # every expert once, by its global name, from the edp shards
        assert f"decoder.layers.2.mlp.experts.local_experts.{e}.linear_fc2.weight" in names
    got = tmp_path / "resumed.jsonl"
    check(run_training([*TINY, *MOE, *load[1], "--load", str(ck), "--log-json", str(got)],
                       nproc=load[0]))
    a, b = read_metrics(reference), read_metrics(got)
    assert sorted(b) == [3, 4]
    for it in (3, 4):
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), it
