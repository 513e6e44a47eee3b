"""The step-time model against Megatron-Bridge's 25.11 DGX-H100 table: every row within its bound
(15% dense, 20% MoE) from one cluster file whose numbers carry their sources; the table's FLOP
formula written out by hand and checked against the table's own tokens/s; each assumed number
breaks a row outside its window."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megazero.planner.cluster import CLUSTER_DIR, load_cluster
from megazero.planner.published_bridge import (
    BRIDGE_H100,
    GPT_OSS_120B,
    LLAMA3_8B,
    bound,
    bridge_flops_per_token,
    padded_vocab,
    predict,
)


@pytest.fixture(scope="module")
def estimates():
    cluster = load_cluster("h100-80gb-nvlink")
    return cluster, [predict(r, cluster) for r in BRIDGE_H100]


def _ratios(estimates, **assumed):
    cluster, ests = estimates
    c = dataclasses.replace(cluster, **assumed)
    return {r.name: e.retime(c).seconds / r.published_seconds for r, e in zip(BRIDGE_H100, ests)}


def test_every_row_within_its_bound(estimates):
    ratios = _ratios(estimates)
    off = {r.name: round(ratios[r.name], 3) for r in BRIDGE_H100
           if abs(ratios[r.name] - 1) > bound(r)}
    assert not off, f"predicted / published outside the bound: {off} (all: {ratios})"
    assert {r.name for r in BRIDGE_H100 if r.moe} == {"GPT-OSS 120B", "Qwen3-30B-A3B",
                                                      "Qwen3-235B-A22B"}
    assert all(bound(r) == (0.20 if r.moe else 0.15) for r in BRIDGE_H100)


def test_bridge_flop_formula_by_hand():
    """Llama-3 8B at sequence 8192, TP 1: MLP 12 l h f (3/2), attention 12 l h^2 (1 + G/a +
    s/2h), logits 6 h V (128256 is already a multiple of 128)."""
    l_, h, f, a, g, s, v = 32, 4096, 14336, 32, 8, 8192, 128256
    want = 12 * l_ * h * f * 1.5 + 12 * l_ * h * h * (1 + g / a + s / h / 2) + 6 * h * v
    assert bridge_flops_per_token(LLAMA3_8B, s, 1) == pytest.approx(want, rel=1e-12)
    # GPT-OSS: a gated quick-GELU unit counts one (the 3/2 is for SiLU only), 4 of 128 experts
    # at width 2880, query width 64 x 64 = 4096 against hidden 2880
    h, q = 2880, 64 * 64
    want = (12 * 36 * h * 2880 * 4 + 12 * 36 * h * h * (1 + 8 / 64 + 4096 / h / 2) * q / h
            + 6 * h * 201088)
    assert bridge_flops_per_token(GPT_OSS_120B, 4096, 1) == pytest.approx(want, rel=1e-12)
    # the vocabulary is padded to 128 x TP: 128256 -> 128512 at TP 4, 129024 at TP 8
    assert (padded_vocab(128256, 1), padded_vocab(128256, 4), padded_vocab(128256, 8)) == \
        (128256, 128512, 129024)


@pytest.mark.parametrize("row", BRIDGE_H100, ids=[r.name for r in BRIDGE_H100])
def test_the_formula_reproduces_the_tables_two_throughputs(row):
    """The table gives tokens/s and TFLOP/s per GPU: their ratio is the formula's FLOPs per
    token, so the step time from either agrees (to the table's rounding, < 0.5%)."""
    from_tokens = row.global_batch * row.seq / (row.gpus * row.tokens_per_s_per_gpu)
    assert row.published_seconds == pytest.approx(from_tokens, rel=5e-3)


def test_h100_file_states_a_source_for_every_number_it_uses():
    data = json.loads((CLUSTER_DIR / "h100-80gb-nvlink.json").read_text())
    used = {k for k, v in data.items() if isinstance(v, (int, float)) and v}
    assert used - set(data["sources"]) <= {"per_layer_overhead_us"}, \
        sorted(used - set(data["sources"]))
    for assumed in ("achievable_fraction", "achievable_fraction_fp8",
                    "expert_kernel_overhead_us"):
        assert data["sources"][assumed].startswith("an assumption"), assumed


@pytest.mark.parametrize("assumed,value,row,side", [
    ("achievable_fraction_fp8", 0.42, "Llama-3 8B", "slow"),
    ("achievable_fraction_fp8", 0.62, "Llama-3.1 405B", "fast"),
    ("expert_kernel_overhead_us", 60.0, "Qwen3-30B-A3B", "fast"),
    ("expert_kernel_overhead_us", 135.0, "Qwen3-30B-A3B", "slow"),
    ("achievable_fraction", 0.44, "GPT-OSS 120B", "slow"),
])
def test_an_assumed_number_outside_its_window_breaks_a_row(estimates, assumed, value, row, side):
    """The bounds are not loose: each assumed number moved past the window the bench prints
    pushes a row out, too slow or too fast."""
    r = next(x for x in BRIDGE_H100 if x.name == row)
    ratio = _ratios(estimates, **{assumed: value})[row]
    assert (ratio > 1 + bound(r)) if side == "slow" else (ratio < 1 - bound(r)), ratio
