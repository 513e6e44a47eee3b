"""The planner prices the overlaps megazero runs: --tp-comm-overlap leaves the first of tp
ring steps and what exceeds the layer's linear GEMMs exposed; --moe-shared-expert-overlap hides
the forward dispatch under the shared expert's forward; both are read from the run's flags in
one place, and the tools print the exposed share with and without them."""

from __future__ import annotations

import pytest

from megazero.planner.cluster import load_cluster
from megazero.planner.comm_overlap import exposed_comm
from megazero.planner.features import features_from_config
from megazero.planner.search import _config
from megazero.planner.step_time import shared_expert_forward_seconds
from tests.test_planner_step_time import AG, BASE, RS, B, H, L, S, cluster, coll, terms

RATE = 1e10
TP2_SP = ["--tensor-model-parallel-size=2", "--sequence-parallel"]


def test_tp_comm_overlap_hides_all_but_the_first_ring_step_under_the_linears():
    act, mb, tp = 4 * S * B * H, 8, 2
    per = 4 * (coll(AG, act / 2) + coll(RS, act / 2))
    linear = B * S * 24 * H * H * 3 / tp / RATE  # a layer's linear GEMMs, fwd + bwd
    plain = terms(TP2_SP)
    over = terms([*TP2_SP, "--tp-comm-overlap"])
    assert plain["tensor parallel"] == pytest.approx(L * mb * per, rel=1e-12)
    want = per / tp + max(0.0, per * (tp - 1) / tp - linear)
    assert over["tensor parallel"] == pytest.approx(L * mb * want, rel=1e-12)
    assert over["tensor parallel"] < plain["tensor parallel"]
    assert over["compute"] == plain["compute"]


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--moe-shared-expert-intermediate-size", "128", "--moe-token-dispatcher-type",
       "alltoall", "--expert-model-parallel-size", "2"]


def test_shared_expert_overlap_hides_the_forward_dispatch_under_the_shared_expert():
    cl = cluster()
    plain = terms(MOE, cl=cl)
    over = terms([*MOE, "--moe-shared-expert-overlap"], cl=cl)
    cfg = _config(BASE, [*MOE, "--moe-shared-expert-overlap"], 2)
    mb = 16 // (B * cfg.layout().dp)
    shared = shared_expert_forward_seconds(cfg, cl, features_from_config(cfg))
    assert shared == pytest.approx(L * B * S * 2 * H * 128 * 2 / RATE, rel=1e-12)
    d = plain["MoE dispatch"] / mb / 2  # the forward half of one micro-batch's dispatch
    assert over["MoE dispatch"] == pytest.approx(mb * (d + max(0.0, d - shared)), rel=1e-12)
    assert over["MoE combine"] == plain["MoE combine"]


def test_features_come_from_the_flags_and_the_tools_print_both_modes():
    cfg = _config(BASE, [*TP2_SP, "--tp-comm-overlap"], 2)
    feats = features_from_config(cfg)
    assert feats.tp_comm_overlap and not feats.moe_shared_expert_overlap
    assert not features_from_config(_config(BASE, TP2_SP, 2)).tp_comm_overlap
    big = ("--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
           "--vocab-size 32000 --tokenizer-type NullTokenizer --global-batch-size 16 "
           "--micro-batch-size 1 --bf16").split()
    cfg = _config(big, ["--tensor-model-parallel-size=8", "--sequence-parallel"], 16)
    ex = exposed_comm(cfg, load_cluster("h100-80gb-nvlink"))
    assert 0 < ex.tp_overlap < ex.tp_plain and ex.step_overlap < ex.step_plain
    assert ex.ep_plain == ex.ep_overlap == 0
    (line,) = ex.lines(cfg)
    assert line.startswith("exposed TP communication: ") and "with --tp-comm-overlap" in line
