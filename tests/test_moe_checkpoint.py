"""An MoE checkpoint saved at EP 2 x TP 2 (SP, ZeRO 1) holds every expert once under its global
name, with the expert biases; it loads at EP 1 (one process) and EP 4 (ZeRO 2) and continues
with the uninterrupted one-process run's losses."""

from __future__ import annotations

import json
import os

import pytest

from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training
from megazero.testing.moe_runs import MOE

SAVE = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-model-parallel-size", "2", "--zero-stage", "1"]


def test_moe_checkpoint_reshards_over_expert_parallel_sizes(tmp_path):
    ref = tmp_path / "ref.jsonl"
    check(run_training([*TINY, *MOE, "--log-json", str(ref)]))
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
