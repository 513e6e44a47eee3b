"""An MoE checkpoint saved at EP 2 x TP 2 (SP, ZeRO 1) holds every expert once under its global
name, with the expert biases; it loads at EP 1 (one process), EP 4 (ZeRO 2) and expert tensor
parallel 2 and continues with the uninterrupted one-process run's losses. One saved at
EP 2 x ETP 2 x TP 2 (experts saved as halves) loads in one process."""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

SAVE = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-model-parallel-size", "2", "--zero-stage", "1"]
ETP2 = ["--expert-tensor-parallel-size", "2", "--zero-stage", "2"]  # every expert split in two


def _same_losses(got, ref, iters=(3, 4)) -> None:
    a, b = read_metrics(ref), read_metrics(got)
    assert sorted(b) == list(iters)
    for it in iters:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), (got, it)
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), (got, it)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_ref") / "ref.jsonl"
    check(run_training([*TINY, *MOE, "--log-json", str(path)]))
    return path


def test_moe_checkpoint_reshards_over_expert_parallel_sizes(tmp_path, ref):
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *SAVE, "--save", str(ck), "--exit-interval", "2"],
                       nproc=4))
    index = json.load(open(os.path.join(ck, "iter_0000002", "metadata.json"), encoding="utf-8"))
    names = set(index["tensors"])
    for layer in (0, 2):
        for e in range(4):
            assert f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight" \
                in names
        assert f"decoder.layers.{layer}.mlp.router.expert_bias" in names
    for nproc, layout in ((1, []), (4, ["--expert-model-parallel-size", "4", "--zero-stage",
                                        "2"]), (2, ETP2)):
        got = tmp_path / f"resumed{nproc}.jsonl"
        check(run_training([*TINY, *MOE, *layout, "--load", str(ck), "--log-json", str(got)],
                           nproc=nproc))
        _same_losses(got, ref)


def test_moe_checkpoint_saved_with_split_experts_loads_whole(tmp_path, ref):
    ck = tmp_path / "ck"
    check(run_training([*TINY, *MOE, *SAVE, "--expert-tensor-parallel-size", "2",
                        "--save", str(ck), "--exit-interval", "2"], nproc=4))
    index = json.load(open(os.path.join(ck, "iter_0000002", "metadata.json"), encoding="utf-8"))
    fc1 = index["tensors"]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert (fc1["tp"], fc1["dim"], fc1["shape"]) == (2, 0, [24, 32])  # two halves of [24, 32]
    got = tmp_path / "resumed.jsonl"
    check(run_training([*TINY, *MOE, "--load", str(ck), "--log-json", str(got)]))
    _same_losses(got, ref)
