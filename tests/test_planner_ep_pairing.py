"""``--overlap-moe-expert-parallel-comm`` in the planner: the flag turns the combined-1F1B
feature on, the share of the micro-batches it pairs is counted from the schedules' step lists
(each case counted by hand below), and the exposed-communication lines price it where the
layout can run it."""

from __future__ import annotations

import re

import pytest

from megazero.pipeline.zero_bubble import schedule_steps
from megazero.planner.cluster import load_cluster
from megazero.planner.comm_overlap import combined_1f1b_fits, exposed_comm, overlap_features
from megazero.planner.features import Features, features_from_config
from megazero.planner.moe_cost import paired_share
from megazero.planner.search import _config

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--vocab-size 128 --tokenizer-type NullTokenizer --global-batch-size 16 "
        "--micro-batch-size 2").split()
MOE = "--num-experts 4 --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2"


def compute(steps) -> list[str]:
    return [str(s[0]) for s in steps if s[0].is_compute]


def test_no_pipelining_pairs_all_but_the_first_forward_and_the_last_backward():
    # F0, (F1 B0), (F2 B1), (F3 B2), B3: 3 of 4
    assert paired_share(1, None, 4) == 3 / 4
    assert paired_share(1, None, 1) == 0.0


def test_interleaved_pairs_its_steady_state_after_one_more_warm_up_forward():
    # pp 2, vpp 2, m 4 (groups of 2), one chunk-forward more of warm-up than 1F1B's:
    # rank 0 pairs (F3.0 B0.1) (F2.1 B1.1) (F3.1 B0.0); the last rank (F1.1 B0.1) (F2.0 B1.1)
    # (F3.0 B0.0) (F2.1 B1.0) (F3.1 B2.1): 3 of 8 chunk-forwards on the rank with the fewest
    assert compute(schedule_steps(2, 2, 4, 0, combined=True)) == [
        "F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "F3.0", "B0.1", "F2.1", "B1.1", "F3.1",
        "B0.0", "B1.0", "B2.1", "B3.1", "B2.0", "B3.0"]
    assert compute(schedule_steps(2, 2, 4, 1, combined=True)) == [
        "F0.0", "F1.0", "F0.1", "F1.1", "B0.1", "F2.0", "B1.1", "F3.0", "B0.0", "F2.1",
        "B1.0", "F3.1", "B2.1", "B3.1", "B2.0", "B3.0"]
    # without the extra warm-up the last rank's loss-chunk forwards meet their own backward
    assert compute(schedule_steps(2, 2, 4, 1))[2:4] == ["F0.1", "B0.1"]
    assert paired_share(2, 2, 4) == 3 / 8
    assert paired_share(2, 2, 4, "interleaved") == 3 / 8
    # not a schedule the combined 1F1B runs: nothing pairs
    assert paired_share(2, None, 4) == 0.0


def test_dualpipev_pairs_its_fb_units():
    # pp 2, m 4, compiled with F&B units: rank 0 runs (F3.0 B1.1) (F2.1 B0.0) (F3.1 B1.0)
    # together (F0.1 B0.1 is one micro-batch), rank 1 four pairs
    steps = schedule_steps(2, None, 4, 0, schedule="dualpipev", combined=True)
    assert compute(steps) == [
        "F0.0", "F1.0", "F2.0", "F0.1", "B0.1", "W0.1", "F1.1", "F3.0", "B1.1", "W1.1",
        "F2.1", "B0.0", "W0.0", "B2.1", "W2.1", "F3.1", "B1.0", "W1.0", "B3.1", "W3.1",
        "B2.0", "W2.0", "B3.0", "W3.0"]
    assert paired_share(2, None, 4, "dualpipev") == 3 / 8
    # pp 8, m 64: rank 0 has the fewest, 105 of its 128 chunk-forwards
    assert paired_share(8, None, 64, "dualpipev") == 105 / 128


def test_the_flag_turns_the_feature_on():
    on = _config(BASE, [*MOE.split(), "--overlap-moe-expert-parallel-comm"], 2)
    assert features_from_config(on).moe_ep_overlap
    assert not features_from_config(_config(BASE, MOE.split(), 2)).moe_ep_overlap


def test_the_combined_mode_is_offered_where_the_config_check_passes():
    assert combined_1f1b_fits(_config(BASE, MOE.split(), 2))
    # 1F1B pipelines pair no forward with a backward: the shared-expert overlap instead
    shared = [*MOE.split(), "--moe-shared-expert-intermediate-size", "64",
              "--pipeline-model-parallel-size", "2"]
    c = _config(BASE, shared, 4)
    assert not combined_1f1b_fits(c)
    feats = overlap_features(c, Features())
    assert feats.moe_shared_expert_overlap and not feats.moe_ep_overlap
    # with virtual stages it fits, and excludes the shared-expert overlap
    c = _config(BASE, [*shared, "--num-layers-per-virtual-pipeline-stage", "1"], 4)
    feats = overlap_features(c, Features())
    assert feats.moe_ep_overlap and not feats.moe_shared_expert_overlap
    line = exposed_comm(c, load_cluster("h100-80gb-nvlink")).lines(c)[-1]
    # dp 2: 4 micro-batches, 2 chunks; rank 0 pairs 3 of its 8 chunk-forwards
    assert re.fullmatch(r"exposed EP communication: \d\.\d{3} s \(\d+\.\d% of the step\); "
                        r"with --overlap-moe-expert-parallel-comm \d\.\d{3} s "
                        r"\(\d+\.\d% of the step\), 37\.5% of the forwards paired with a "
                        r"backward", line), line


def test_combined_mode_lowers_the_exposed_traffic_by_the_paired_share():
    from megazero.planner.estimate import estimate
    from megazero.planner.moe_cost import overlapped_traffic

    c, cl, mb = _config(BASE, MOE.split(), 2), load_cluster("h100-80gb-nvlink"), 4
    ex = exposed_comm(c, cl)
    plain = estimate(c, cl, features=Features()).time.terms
    experts = (plain["MoE grouped GEMM"] + plain["MoE permute"]) / mb
    dense = sum(v for k, v in plain.items() if k in ("compute",)) / mb
    per_mb = {"dispatch": plain["MoE dispatch"] / mb, "combine": plain["MoE combine"] / mb}
    want = mb * sum(overlapped_traffic(per_mb, dense, experts, 3 / 4).values())
    assert ex.ep_paired == 3 / 4
    assert ex.ep_plain == pytest.approx(mb * sum(per_mb.values()), rel=1e-12)
    assert ex.ep_overlap == pytest.approx(want, rel=1e-12)
    assert ex.ep_plain / 4 <= ex.ep_overlap < ex.ep_plain  # F0's and B3's stay exposed


def test_the_memory_estimate_holds_the_paired_forward():
    """The combined order runs a forward before the backward it pairs with: without
    pipelining two micro-batches' activations are held at once instead of one; on the
    interleaved schedule one chunk-micro-batch more than megatron-core's warm-up."""
    from megazero.planner.activations import chunk_saved_bytes, peak_saved_bytes

    for extra, world in (([], 2), (["--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1"], 4)):
        plain = _config(BASE, [*MOE.split(), *extra], world)
        on = _config(BASE, [*MOE.split(), *extra, "--overlap-moe-expert-parallel-comm"], world)
        chunks = chunk_saved_bytes(plain, 0, flash=True)
        got = peak_saved_bytes(on, 0, 4, flash=True) - peak_saved_bytes(plain, 0, 4, flash=True)
        # one more (chunk, micro-batch): rank 0's chunk 0 holds the embedding, chunk 1 not
        assert any(got == pytest.approx(c) for c in chunks), (extra, got, chunks)
