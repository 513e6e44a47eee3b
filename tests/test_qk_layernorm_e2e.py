"""``pretrain_gpt.py`` with ``--qk-layernorm`` trains the same model at every layout.

A Llama-style tiny model (RMSNorm, SwiGLU, RoPE, grouped-query attention, a head width set by
``--kv-channels`` that is not hidden / heads) with query/key norms: at TP 2 (with and without
sequence parallelism), TP 2 x PP 2, ZeRO 3, and CP 2 with each ``--cp-comm-type`` (Ulysses'
all-to-all splitting the heads of a TP rank over CP), the losses, grad norms and validation
loss and the saved weights (the q/k norms' included) equal the one-process run to fp32
rounding. A TP rank's q/k norm gradient covers only its heads: without the sum over TP the
norm weights of the TP layouts differ from the second step on.
"""

from __future__ import annotations

import json

import pytest

from megazero.checkpoint.shard_reader import read_model_state
from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training

QK = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
      "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--qk-layernorm",
      "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
      "--kv-channels", "8", "--lr", "1e-2", "--train-iters", "4", "--eval-interval", "4",
      "--eval-iters", "1"]

TP2, SP = ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"]
LAYOUTS = [
    (2, [*TP2, "--zero-stage", "3"]),
    (4, [*TP2, *SP, "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
    (4, [*TP2, "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--zero-stage", "0"]),
    (4, [*TP2, *SP, "--context-parallel-size", "2", "--cp-comm-type", "p2p",
         "--zero-stage", "3"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--zero-stage", "2"]),
]


def _validation(path) -> float:
    recs = [json.loads(x) for x in open(path, encoding="utf-8")]
    return [r for r in recs if "lm loss validation" in r][-1]["lm loss validation"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("qk")
    check(run_training([*TINY, *QK, "--log-json", str(d / "ref.jsonl"), "--save",
                        str(d / "ckpt"), "--save-interval", "4"]))
    _, weights = read_model_state(str(d / "ckpt"))
    norms = [n for n in weights if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
    assert len(norms) == 8  # two per layer, trained away from their unit init
    assert all(weights[n].shape == (8,) and (weights[n] - 1).abs().max() > 1e-3 for n in norms)
    return d / "ref.jsonl", weights


@pytest.mark.parametrize("nproc,layout", LAYOUTS, ids=[
    "tp2-z3", "tp2sp-pp2-z1", "tp2-cp2a2a-z0", "tp2sp-cp2p2p-z3", "cp2allgather-z2"])
def test_qk_layernorm_layout_trains_the_one_process_model(reference, tmp_path, nproc, layout):
    reference, weights = reference
    a = read_metrics(reference)
    assert len(a) == 4
    got = tmp_path / "got.jsonl"
    check(run_training([*TINY, *QK, *layout, "--log-json", str(got), "--save",
                        str(tmp_path / "ckpt"), "--save-interval", "4"], nproc=nproc))
    b = read_metrics(got)
    assert sorted(b) == sorted(a)
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), it
    assert _validation(got) == pytest.approx(_validation(reference), rel=LOSS_RTOL)
    _, mine = read_model_state(str(tmp_path / "ckpt"))
    assert sorted(mine) == sorted(weights)
    for name, w in weights.items():
        assert (mine[name] - w).abs().max().item() <= 2e-6 * max(w.abs().max().item(), 1.0), name
