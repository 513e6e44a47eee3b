"""The step-time model's structure on fixed calibration constants: each term against its
formula written out by hand (no timing); and the overlaps megazero runs: --tp-comm-overlap
leaves the first of tp ring steps and what exceeds the layer's linear GEMMs exposed,
--moe-shared-expert-overlap hides the forward dispatch under the shared expert's forward, both
read from the run's flags, and the tools print the exposed share with and without them."""

from __future__ import annotations

import pytest

from megazero.planner.cluster import load_cluster
from megazero.planner.comm_overlap import exposed_comm
from megazero.planner.features import features_from_config
from megazero.planner.search import _config
from megazero.planner.step_time import shared_expert_forward_seconds, step_time
from megazero.testing.step_time_terms import (  # noqa: F401
    AG,
    AR,
    BASE,
    BUCKETS,
    LAYER_US,
    MB_US,
    P2P,
    PARAMS,
    RATE,
    RS,
    UNITS,
    B,
    H,
    L,
    S,
    V,
    cluster,
    terms,
)


def gemm_per_mb(layers: float, tp: int = 1, extra_dense_passes: int = 0) -> float:
    """Forward+backward GEMM seconds of one micro-batch on a stage of ``layers`` layers (+ the
    logits when it is the last): dense 24h^2, attention 4sh, logits 2hV FLOPs per token."""
    dense, attn = 24 * H * H, 4 * S * H
    per_token = layers * ((3 + extra_dense_passes) * dense + 3 * attn)
    return B * S * (per_token + 3 * 2 * H * V) / tp / RATE


def coll(ab: tuple[float, float], wire: float) -> float:
    return ab[0] * 1e-6 + wire / (ab[1] * 1e9)


def test_dp_compute_overheads_and_stage0_all_reduce():
    t = terms(["--zero-stage=0"])
    mb = 4
    assert t["compute"] == pytest.approx(mb * (gemm_per_mb(L) + 3 * L * LAYER_US * 1e-6
                                               + MB_US * 1e-6), rel=1e-12)
    # one bucket: all-reduce of 4-byte gradients, ring wire 2(n-1)/n
    assert t["data parallel"] == pytest.approx(coll(AR, 2 * 4 * PARAMS / 2), rel=1e-12)
    assert t["optimizer step"] == pytest.approx(PARAMS / 0.2e9, rel=1e-12)  # unsharded


def test_stage1_reduce_scatter_all_gather_and_sharded_step():
    t = terms(["--zero-stage=1"])
    assert t["data parallel"] == pytest.approx(coll(RS, 4 * PARAMS / 2) + coll(AG, 4 * PARAMS / 2),
                                               rel=1e-12)
    assert t["optimizer step"] == pytest.approx(PARAMS / 2 / 0.2e9, rel=1e-12)


def test_overlap_hides_dp_comm_only_where_the_cluster_overlaps():
    on = cluster(comm_overlaps_compute=True)
    # the reduce-scatter (~4 ms) hides behind the last micro-batch's backward (~10 ms); the
    # parameters' all-gather after the step stays exposed unless it overlaps the next forward
    hidden = terms(["--zero-stage=1", "--overlap-grad-reduce"], cl=on)
    assert hidden["data parallel"] == pytest.approx(coll(AG, 4 * PARAMS / 2), rel=1e-12)
    both = terms(["--zero-stage=1", "--overlap-grad-reduce", "--overlap-param-gather"], cl=on)
    assert both["data parallel"] == 0.0
    assert terms(["--zero-stage=1"])["data parallel"] > 0.0
    # the run's own setting decides, as in estimate_memory.py: no overlap, nothing hidden
    assert terms(["--zero-stage=1"], cl=cluster(comm_overlaps_compute=True))[
        "data parallel"] > 0.0


def test_gradient_reduction_hides_behind_the_last_microbatch_backward_only():
    """Gradients accumulate under no_sync: a 20 ms reduce-scatter is longer than the last of 4
    micro-batches' backward (2/3 of a quarter of compute), shorter than 2/3 of all compute."""
    slow = {"all_gather": list(AG), "reduce_scatter": [RS[0], 0.1], "all_reduce": list(AR),
            "send_recv": list(P2P)}
    t = terms(["--zero-stage=1", "--overlap-grad-reduce", "--overlap-param-gather"],
              cl=cluster(comm_overlaps_compute=True, collectives=slow))
    per_mb = t["compute"] / 4
    reduce = coll((RS[0], 0.1), 4 * PARAMS / 2)
    assert reduce < t["compute"] * 2 / 3
    assert t["data parallel"] == pytest.approx(reduce - per_mb * 2 / 3, rel=1e-12)


def test_zero3_gathers_and_reduces_per_microbatch():
    """Every micro-batch gathers each unit twice and reduce-scatters each bucket once (its
    gradients partitioned across the accumulation, as DeepSpeed's ZeRO-3)."""
    t = terms(["--zero-stage=3"])
    mb = 4
    assert t["data parallel"] == pytest.approx(
        mb * (2 * 4 * PARAMS / 2 / (AG[1] * 1e9) + 4 * PARAMS / 2 / (RS[1] * 1e9)), rel=1e-12)
    assert t["ZeRO-3 gather latency"] == pytest.approx(
        mb * (UNITS * 2 * AG[0] + BUCKETS * RS[0]) * 1e-6, rel=1e-12)
    assert t["compute"] == terms(["--zero-stage=1"])["compute"]


def test_full_recompute_adds_one_layer_forward_and_one_overhead_pass():
    """A recomputed layer reruns its whole forward, the core attention (4sh) included; by
    ``block`` only the first --recompute-num-layers of each chunk do."""
    none = terms(["--zero-stage=1"])["compute"]
    full = terms(["--zero-stage=1", "--recompute-granularity=full", "--recompute-method=uniform",
                  "--recompute-num-layers=1"])["compute"]
    mb = 4
    one_layer = B * S * (24 * H * H + 4 * S * H) / RATE + LAYER_US * 1e-6
    assert full - none == pytest.approx(mb * L * one_layer, rel=1e-9)
    block = terms(["--zero-stage=1", "--recompute-granularity=full", "--recompute-method=block",
                   "--recompute-num-layers=1"])["compute"]
    assert block - none == pytest.approx(mb * 1 * one_layer, rel=1e-9)  # 1 of the 4 layers


@pytest.mark.parametrize("mbs", [4, 2, 1])
def test_pipeline_bubble_is_p_minus_1_over_m_of_the_slowest_stage(mbs):
    flags = ["--pipeline-model-parallel-size=2", f"--micro-batch-size={mbs}"]
    cfg = _config(BASE, flags, 2)
    mb = 16 // mbs
    t = step_time(cfg, cluster(), mb, PARAMS, 0).terms
    per_mb = mbs / B * gemm_per_mb(L / 2) + 3 * (L / 2) * LAYER_US * 1e-6 + MB_US * 1e-6
    assert t["compute"] == pytest.approx(mb * per_mb, rel=1e-12)  # the last stage: + logits
    assert t["pipeline bubble"] / t["compute"] == pytest.approx(1 / mb, rel=1e-12)
    act = 4 * S * mbs * H
    assert t["pipeline p2p"] == pytest.approx(2 * mb * coll(P2P, act), rel=1e-12)


def test_interleaving_divides_the_bubble_by_v():
    flags = ["--pipeline-model-parallel-size=2", "--num-layers-per-virtual-pipeline-stage=1"]
    t = terms(flags)
    assert t["pipeline bubble"] / t["compute"] == pytest.approx(1 / (2 * 8), rel=1e-12)


def test_tensor_parallel_all_reduces_vs_sequence_parallel_gathers():
    act = 4 * S * B * H
    mb = 8
    plain = terms(["--tensor-model-parallel-size=2"])
    assert plain["tensor parallel"] == pytest.approx(L * mb * 4 * coll(AR, 2 * act / 2),
                                                     rel=1e-12)
    assert plain["compute"] == pytest.approx(mb * (gemm_per_mb(L, tp=2) + 3 * L * LAYER_US * 1e-6
                                                   + MB_US * 1e-6), rel=1e-12)
    sp = terms(["--tensor-model-parallel-size=2", "--sequence-parallel"])
    # per layer two linear pairs, each all-gathers 3 times (forward input, backward output
    # gradient, input re-gathered for the weight gradient) and reduce-scatters twice
    assert sp["tensor parallel"] == pytest.approx(
        L * mb * (6 * coll(AG, act / 2) + 4 * coll(RS, act / 2)), rel=1e-12)


def test_full_recompute_repeats_the_forward_collectives():
    """Recomputing a layer runs its forward again, its TP / SP collectives included: 6
    all-reduces per layer and micro-batch instead of 4, with SP 2 more all-gathers and
    reduce-scatters (selective recompute: none)."""
    act, mb, full = 4 * S * B * H, 8, ["--recompute-granularity=full",
                                      "--recompute-method=uniform", "--recompute-num-layers=1"]
    plain = terms(["--tensor-model-parallel-size=2", *full])
    assert plain["tensor parallel"] == pytest.approx(L * mb * 6 * coll(AR, 2 * act / 2),
                                                     rel=1e-12)
    sp = terms(["--tensor-model-parallel-size=2", "--sequence-parallel", *full])
    assert sp["tensor parallel"] == pytest.approx(
        L * mb * (8 * coll(AG, act / 2) + 6 * coll(RS, act / 2)), rel=1e-12)
    selective = terms(["--tensor-model-parallel-size=2", "--recompute-granularity=selective"])
    assert selective["tensor parallel"] == pytest.approx(L * mb * 4 * coll(AR, 2 * act / 2),
                                                         rel=1e-12)


def test_without_a_measured_table_the_link_bandwidth_and_latency_are_used():
    t = terms(["--zero-stage=0"], cl=cluster(collectives=None))
    assert t["data parallel"] == pytest.approx(30e-6 + 2 * 4 * PARAMS / 2 / 3e9, rel=1e-12)


def test_nongemm_work_repeats_on_tp_ranks_unless_sequence_parallel():
    cl = cluster(nongemm_share=0.5)
    mb, over = 8, 3 * L * LAYER_US * 1e-6 + MB_US * 1e-6
    gemm = gemm_per_mb(L, tp=2)
    plain = terms(["--tensor-model-parallel-size=2"], cl=cl)["compute"]
    assert plain == pytest.approx(mb * (gemm + 2 * gemm * 0.5 + over), rel=1e-12)
    sp = terms(["--tensor-model-parallel-size=2", "--sequence-parallel"], cl=cl)["compute"]
    assert sp == pytest.approx(mb * (gemm + gemm * 0.5 + over), rel=1e-12)


def test_bubble_runs_at_the_solo_speed():
    t = terms(["--pipeline-model-parallel-size=2"], cl=cluster(solo_speedup=2.0))
    assert t["pipeline bubble"] / t["compute"] == pytest.approx(1 / 8 / 2.0, rel=1e-12)


def test_estimate_charges_one_reduce_scatter_per_gradient_bucket():
    from dataclasses import replace

    from megazero.planner.estimate import estimate
    from megazero.planner.shapes import meta_chunks, shape_topology
    from megazero.zero.units import unit_param_groups

    cfg = _config(BASE, ["--zero-stage=3"], 2)
    units = sum(len(unit_param_groups(c)) for c in meta_chunks(cfg, shape_topology(cfg.layout())))

    def latency(bucket: int) -> float:
        c = replace(cfg, zero=replace(cfg.zero, reduce_bucket_size=bucket))
        return estimate(c, cluster()).time.terms["ZeRO-3 gather latency"]

    # every unit alone against the whole model in one bucket: units - 1 more calls per
    # micro-batch
    mb = 16 // (B * cfg.layout().dp)
    assert latency(1) - latency(10**12) == pytest.approx(
        mb * (units - 1) * RS[0] * 1e-6, rel=1e-9)
    assert units > 5


def test_estimate_gathers_only_the_units_at_or_above_the_persistence_threshold():
    from dataclasses import replace

    from megazero.planner.estimate import estimate
    from megazero.planner.shapes import meta_chunks, shape_topology
    from megazero.zero.units import unit_param_groups

    cfg = _config(BASE, ["--zero-stage=3"], 2)
    mb = 16 // (B * cfg.layout().dp)
    sizes = [sum(p.numel() for p in ps) for c in meta_chunks(cfg, shape_topology(cfg.layout()))
             for ps, _ in unit_param_groups(c)]
    threshold = H * H  # the LayerNorms and biases stay (persistent), the GEMM weights gather

    def latency(t: int) -> float:
        c = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=t,
                                      reduce_bucket_size=10**12))
        return estimate(c, cluster()).time.terms["ZeRO-3 gather latency"]

    gathered = sum(n >= threshold for n in sizes)
    assert 0 < gathered < len(sizes)
    per_unit = mb * 2 * AG[0] * 1e-6  # a gather in forward and in backward per micro-batch
    assert latency(threshold) - latency(10**12) == pytest.approx(gathered * per_unit, rel=1e-9)
    assert latency(0) - latency(10**12) == pytest.approx(len(sizes) * per_unit, rel=1e-9)


@pytest.mark.parametrize("schedule, idle", [("zb-h1", 1 / 3), ("zbv", 1 / 6),
                                            ("dualpipev", 1 / 6)])
def test_zero_bubble_schedules_are_priced_by_their_simulated_bubble(schedule, idle):
    """pp 2, m 8, F = B = W: 1F1B idles one micro-batch of a stage; ZB-H1 a third of it, ZBV
    and DualPipeV a sixth (the checker's simulation of the schedules megazero runs)."""
    base = terms(["--pipeline-model-parallel-size=2"])
    t = terms(["--pipeline-model-parallel-size=2", f"--pipeline-schedule={schedule}",
               "--untie-embeddings-and-output-weights"])
    assert base["pipeline bubble"] / base["compute"] == pytest.approx(1 / 8, rel=1e-12)
    assert t["pipeline bubble"] / t["compute"] == pytest.approx(idle / 8, rel=1e-3)


@pytest.mark.parametrize("flags", [
    ["--pipeline-model-parallel-layout=E|t*3|t*2|L", "--pipeline-schedule=zbv"],
    ["--decoder-first-pipeline-num-layers=3"],
    ["--pipeline-model-parallel-layout=E|t*3|t*2|L"],
    ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
     "--num-layers=6"]])
def test_each_stage_is_charged_its_own_layers_embedding_and_loss(flags):
    """Uneven splits and the V: the parameters the estimator counts per pipeline rank are
    those of the chunks the run builds."""
    from megazero.planner.layer_params import stage_numel
    from megazero.planner.shapes import meta_chunks, shape_topology

    base = [*BASE, "--num-layers=5", "--untie-embeddings-and-output-weights"]
    cfg = _config(base, ["--pipeline-model-parallel-size=2", *flags], 2)
    counts = []
    for r in range(2):
        chunks = meta_chunks(cfg, shape_topology(cfg.layout(), r))
        counts.append(sum(p.numel() for c in chunks for p in c.parameters()))
        assert stage_numel(cfg, r) == counts[-1]
    assert counts[0] != counts[1]


# --- the overlaps megazero runs (--tp-comm-overlap, --moe-shared-expert-overlap) ------------

TP2_SP = ["--tensor-model-parallel-size=2", "--sequence-parallel"]


def test_tp_comm_overlap_exposes_each_calls_latency_and_the_bytes_beyond_its_gemm():
    """Per linear pair: 3 ring steps (forward all-gather and reduce-scatter, backward output
    gradient all-gather) of a 1/tp chunk under 1/tp of a GEMM, and the backward's bulk
    all-gather and reduce-scatter under a whole GEMM; each exposes its latency, and its bytes
    where they outlast the GEMM (here the slow reduce-scatter's)."""
    act, mb, tp = 4 * S * B * H, 8, 2
    gemm = B * S * 24 * H * H / 4 / tp / RATE  # one of a pair's GEMMs: 1/4 of the layer's
    rs = (RS[0], 0.05)  # a reduce-scatter slower than the GEMM it runs under
    cl = cluster(collectives={"all_gather": list(AG), "reduce_scatter": list(rs),
                              "all_reduce": list(AR), "send_recv": list(P2P)})
    plain = terms(TP2_SP, cl=cl)
    over = terms([*TP2_SP, "--tp-comm-overlap"], cl=cl)
    ring = P2P[0] * 1e-6 + max(0.0, act / tp / (P2P[1] * 1e9) - gemm / tp)
    bulk_ag = AG[0] * 1e-6 + max(0.0, act / 2 / (AG[1] * 1e9) - gemm)
    bulk_rs = rs[0] * 1e-6 + max(0.0, act / 2 / (rs[1] * 1e9) - gemm)
    assert act / 2 / (rs[1] * 1e9) > gemm > act / 2 / (AG[1] * 1e9)  # both branches
    want = 2 * (3 * ring + bulk_ag + bulk_rs)
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
