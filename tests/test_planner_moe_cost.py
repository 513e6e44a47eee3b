"""The step-time model's MoE terms against formulas written out by hand: the compute counts
the router and the k active experts; the dispatcher's traffic per MoE layer, both dispatchers,
inside a node (measured alpha/beta) and across nodes (NVLink and NIC shares)."""

from __future__ import annotations

import pytest

from megazero.planner.cluster import Cluster
from megazero.planner.search import _config
from megazero.planner.step_time import step_time

L, H, S, V, B = 4, 64, 32, 128, 2
BASE = (f"--num-layers {L} --hidden-size {H} --num-attention-heads 4 --seq-length {S} "
        f"--vocab-size {V} --tokenizer-type NullTokenizer --global-batch-size 16 "
        f"--micro-batch-size {B}").split()
RATE = 1e10  # FLOP/s reached (peak 2e10 x 0.5)
AG, RS, PARAMS = (50.0, 1.0), (60.0, 0.5), 1_000_000  # alpha us, GB/s


def cluster(**kw) -> Cluster:
    base = dict(name="test", device="cpu", memory_gb=16, peak_tflops_16=0.02,
                peak_tflops_32=0.02, gpus_per_node=8, intra_node_gbps=3.0, inter_node_gbps=1.0,
                pcie_gbps=10.0, host_memory_gb=16, cpu_adam_gparams_per_s=0.1,
                achievable_fraction=0.5, per_collective_latency_us=30.0,
                per_layer_overhead_us=100.0, per_microbatch_overhead_us=1000.0,
                comm_overlaps_compute=False, device_adam_gparams_per_s=0.2,
                collectives={"all_gather": list(AG), "reduce_scatter": list(RS)})
    return Cluster(**{**base, **kw})

A2A = (40.0, 1.5)  # alpha us, GB/s
E, K, F = 8, 2, 48
MOE = (f"--num-experts {E} --moe-router-topk {K} --moe-ffn-hidden-size {F} "
       "--disable-bias-linear --zero-stage 0").split()


def moe_terms(flags, world=4, **kw):
    cfg = _config(BASE, MOE + flags, world)
    mb = 16 // (B * cfg.layout().dp)
    return cfg, mb, step_time(cfg, cluster(**kw), mb, PARAMS).terms


def coll(ab, wire):
    return ab[0] * 1e-6 + wire / (ab[1] * 1e9)


def _both(t):
    """The dispatcher's whole traffic: the dispatch and the combine terms."""
    return t["MoE dispatch"] + t["MoE combine"]


def test_compute_counts_the_router_and_k_active_experts():
    _, mb, t = moe_terms(["--expert-model-parallel-size", "4"])
    dense, attn = 24 * H * H - 2 * 2 * H * 4 * H, 4 * S * H  # attention + projection GEMMs
    expert = 2 * H * E + K * (2 * H * F + 2 * F * H)  # router + k GELU experts, per token
    per_token = L * (3 * (dense + expert) + 3 * attn) + 3 * 2 * H * V
    gemm = B * S * per_token / RATE
    overhead = 3 * L * 100e-6 + 1000e-6  # the cluster's per-layer and per-micro-batch costs
    # the experts' grouped GEMM is a term of its own (the dense rate on this cluster, which
    # states no grouped-GEMM efficiency)
    experts = B * S * L * 3 * K * (2 * H * F + 2 * F * H) / RATE
    assert t["MoE grouped GEMM"] == pytest.approx(mb * experts, rel=1e-12)
    assert t["compute"] + t["MoE grouped GEMM"] == pytest.approx(mb * (gemm + overhead),
                                                                  rel=1e-12)


def test_alltoall_dispatch_inside_a_node():
    cols = {"all_gather": list(AG), "reduce_scatter": list(RS), "all_to_all": list(A2A)}
    # (an all-to-all without a measured entry would take the latency and NVLink)
    for ep in (2, 4):
        cfg, mb, t = moe_terms(["--expert-model-parallel-size", str(ep),
                                "--moe-token-dispatcher-type", "alltoall"], collectives=cols)
        rows = K * B * S * H * 4  # fp32 rows of the k copies of each token
        a2a = coll(A2A, rows * (ep - 1) / ep)
        counts = coll(AG, 8 * ep * E * (ep - 1) / ep)
        per_layer = counts + 2 * a2a + 2 * a2a  # dispatch + combine, forward and backward
        assert _both(t) == pytest.approx(mb * L * per_layer, rel=1e-12), ep
        # the dispatch: the counts and the rows out (forward) with their gradient back
        assert t["MoE combine"] == pytest.approx(mb * L * 2 * a2a, rel=1e-12), ep
    # full recompute repeats the forward's three collectives
    _, mb, t = moe_terms(["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type",
                          "alltoall", "--recompute-granularity", "full",
                          "--recompute-method", "uniform"], collectives=cols)
    rows = K * B * S * H * 4
    per_layer = 2 * coll(AG, 8 * 4 * E * 3 / 4) + 6 * coll(A2A, rows * 3 / 4)
    assert _both(t) == pytest.approx(mb * L * per_layer, rel=1e-12)


def test_allgather_dispatch_inside_a_node():
    _, mb, t = moe_terms(["--expert-model-parallel-size", "4",
                          "--moe-token-dispatcher-type", "allgather"])
    ep, tokens = 4, 4 * B * S
    act, probs, rmap = tokens * H * 4, tokens * E * 4, tokens * E
    frac = (ep - 1) / ep
    fwd = coll(AG, act * frac) + coll(AG, probs * frac) + coll(AG, rmap * frac) \
        + coll(RS, act * frac)
    bwd = coll(RS, act * frac) + coll(RS, probs * frac) + coll(AG, act * frac)
    assert _both(t) == pytest.approx(mb * L * (fwd + bwd), rel=1e-12)


def test_alltoall_across_nodes_takes_the_slower_of_nvlink_and_nic():
    # 2 ranks per node, EP 4: each rank sends 1/4 of its rows over NVLink (3 GB/s) and 2/4
    # over its NIC (1 GB/s); no measured table, so alpha is the cluster's 30 us
    _, mb, t = moe_terms(["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type",
                          "alltoall"], gpus_per_node=2, collectives=None)
    rows = K * B * S * H * 4
    a2a = 30e-6 + max(rows / 4 / 3e9, rows * 2 / 4 / 1e9)
    # the counts' all-gather rings over the group's 2 NICs per node: min(3, 2 x 1) GB/s
    counts = 30e-6 + 8 * 4 * E * 3 / 4 / 2e9
    assert _both(t) == pytest.approx(mb * L * (counts + 4 * a2a), rel=1e-12)


def test_expert_tensor_parallel_gathers_and_reduce_scatters_the_routed_rows():
    # ETP 2 alone (EP 1: no dispatcher traffic), then with EP 2 and the all-to-all
    rows = K * B * S * H * 4
    frac = 1 / 2
    etp = coll(AG, 2 * rows * frac) + coll(RS, 2 * rows * frac)  # over the etp group
    _, mb, t = moe_terms(["--expert-tensor-parallel-size", "2"])
    assert _both(t) == pytest.approx(mb * L * 2 * etp, rel=1e-12)  # fwd + bwd
    cols = {"all_gather": list(AG), "reduce_scatter": list(RS), "all_to_all": list(A2A)}
    _, mb, t = moe_terms(["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size",
                          "2", "--moe-token-dispatcher-type", "alltoall"], collectives=cols)
    a2a = 4 * coll(A2A, rows / 2) + coll(AG, 8 * 2 * E / 2)
    assert _both(t) == pytest.approx(mb * L * (a2a + 2 * etp), rel=1e-12)


def test_no_dispatch_term_at_ep1_and_mfu_counts_active_parameters():
    from megazero.observability.flops import gpt_flops_per_iteration

    cfg = _config(BASE, MOE, 4)
    out = step_time(cfg, cluster(), 2, PARAMS)
    assert "MoE dispatch" not in out.terms
    assert out.model_flops == gpt_flops_per_iteration(cfg.model, 16)
