"""An MoE checkpoint saved at EP 2 x TP 2 (SP, ZeRO 1) holds every expert once under its global
name, with the expert biases; it loads at EP 1 (one process), EP 4 (ZeRO 2), EP 2 with
ZeRO 3 (experts partitioned over their expert-data-parallel group of 2, dense weights over dp
4) and expert tensor parallel 2, and continues with the uninterrupted one-process run's losses.
One saved at EP 2 with ZeRO 3 holds every expert once too, from the edp shards, and loads at
EP 1 with ZeRO 1; one saved at EP 2 x ETP 2 x TP 2 (experts saved as halves) loads in one
process. The ZeRO-3 runs keep their parameter shards in NVMe swap files (saved from them,
loaded into them)."""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

SAVE = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-model-parallel-size", "2", "--zero-stage", "1"]
EP2_ZERO3 = ["--expert-model-parallel-size", "2", "--zero-stage", "3", "--deepspeed_config",
             "NVME"]
ETP2 = ["--expert-tensor-parallel-size", "2", "--zero-stage", "2"]  # every expert split in two


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = tmp_path_factory.mktemp("moe_ck") / "ref.jsonl"
    check(run_training([*TINY, *MOE, "--log-json", str(ref)]))
    return ref


def _nvme(tmp_path, args: list[str]) -> list[str]:
    """``args`` with the NVMe parameter-offload config (every unit partitioned) in place."""
    cfg = tmp_path / "nvme.json"
    if not cfg.exists():
        (tmp_path / "swap").mkdir()
        cfg.write_text(json.dumps({"zero_optimization": {"offload_param": {
            "device": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_count": 8,
            "buffer_size": 4096, "max_in_cpu": 0}, "stage3_param_persistence_threshold": 0}}))
    return [str(cfg) if x == "NVME" else x for x in args]


def _check_every_expert_once(ck) -> None:
    index = json.load(open(os.path.join(ck, "iter_0000002", "metadata.json"), encoding="utf-8"))
    names = set(index["tensors"])
    for layer in (0, 2):
        for e in range(4):
            assert f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight" \
                in names
        assert f"decoder.layers.{layer}.mlp.router.expert_bias" in names


def _resume_matches(reference, tmp_path, ck, nproc: int, layout: list[str], tag: str) -> None:
    got = tmp_path / f"resumed-{tag}.jsonl"
    check(run_training([*TINY, *MOE, *layout, "--load", str(ck), "--log-json", str(got)],
                       nproc=nproc))
    a, b = read_metrics(reference), read_metrics(got)
    assert sorted(b) == [3, 4]
    for it in (3, 4):
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), (tag, it)
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), (tag, it)


def test_moe_checkpoint_reshards_over_expert_parallel_sizes(tmp_path, reference):
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *SAVE, "--save", str(ck), "--exit-interval", "2"],
                       nproc=4))
    _check_every_expert_once(ck)
    for nproc, layout, tag in ((1, [], "ep1"),
                               (4, ["--expert-model-parallel-size", "4", "--zero-stage", "2"],
                                "ep4-zero2"),
                               (4, _nvme(tmp_path, EP2_ZERO3), "ep2-zero3-edp2"),
                               (2, ETP2, "etp2-zero2")):
        _resume_matches(reference, tmp_path, ck, nproc, layout, tag)


def test_moe_checkpoint_saved_at_zero3_over_edp_loads_at_ep1_zero1(tmp_path, reference):
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *_nvme(tmp_path, EP2_ZERO3), "--save", str(ck),
                        "--exit-interval", "2"], nproc=4))
    _check_every_expert_once(ck)
    _resume_matches(reference, tmp_path, ck, 2, ["--zero-stage", "1"], "ep1-zero1")


def test_moe_checkpoint_saved_with_split_experts_loads_whole(tmp_path, reference):
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *SAVE, "--expert-tensor-parallel-size", "2",
                        "--save", str(ck), "--exit-interval", "2"], nproc=4))
    _check_every_expert_once(ck)
    index = json.load(open(os.path.join(ck, "iter_0000002", "metadata.json"), encoding="utf-8"))
    fc1 = index["tensors"]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert (fc1["tp"], fc1["dim"], fc1["shape"]) == (2, 0, [24, 32])  # two halves of [24, 32]
    _resume_matches(reference, tmp_path, ck, 1, [], "etp-saved-ep1")
