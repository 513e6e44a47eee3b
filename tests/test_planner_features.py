"""The step-time model's terms for features megazero's training lacks (FP8, overlap, Megatron's
pipeline slots, sliding windows) and its MoE compute, each against its formula written out by
hand on a small model and a hand-made cluster (no timing)."""

from __future__ import annotations

import dataclasses

import pytest

from megazero.config import load_config
from megazero.planner.cluster import Cluster
from megazero.planner.features import Features
from megazero.planner.moe_cost import overlapped_traffic
from megazero.planner.step_time import step_time

L, H, A, S, V, B, F = 4, 256, 8, 128, 512, 2, 1024
RATE16, RATE8, HBM = 1e12, 2e12, 100e9  # FLOP/s (fractions 1), bytes/s
TOKENS = B * S
# forward FLOPs per token of a layer's linear layers: QKV, projection, a two-matrix MLP
LINEAR = 2 * H * (3 * H) + 2 * H * H + 2 * (2 * H * F)
FP8 = Features(fp8="tensorwise")


def cluster(**kw) -> Cluster:
    base = dict(name="gpu-test", device="test", memory_gb=80, peak_tflops_16=RATE16 / 1e12,
                peak_tflops_32=RATE16 / 1e12, gpus_per_node=8, intra_node_gbps=300.0,
                inter_node_gbps=25.0, pcie_gbps=32.0, host_memory_gb=1000,
                cpu_adam_gparams_per_s=1.0, achievable_fraction=1.0,
                per_collective_latency_us=0.0, hbm_gbps=HBM / 1e9,
                peak_tflops_fp8=RATE8 / 1e12, achievable_fraction_fp8=1.0)
    return Cluster(**{**base, **kw})


def cfg(extra: str = "", world: int = 1, layers: int = L, vocab: int = V):
    argv = (f"--num-layers {layers} --hidden-size {H} --num-attention-heads {A} --seq-length {S} "
            f"--ffn-hidden-size {F} --vocab-size {vocab} --make-vocab-size-divisible-by 1 "
            f"--tokenizer-type NullTokenizer --bf16 --micro-batch-size {B} --global-batch-size "
            f"{B * world} --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 "
            f"--zero-stage 0 {extra}").split()
    return load_config(argv, world)


def test_fp8_linear_layers_run_at_the_fp8_rate_and_pay_their_casts():
    c, cl = cfg(), cluster()
    bf16, fp8 = step_time(c, cl, 1, 0).terms, step_time(c, cl, 1, 0, features=FP8).terms
    assert "FP8 casts" not in bf16
    saved = TOKENS * L * 3 * LINEAR * (1 / RATE16 - 1 / RATE8)
    assert bf16["compute"] - fp8["compute"] == pytest.approx(saved, rel=1e-9)
    # per token and layer: QKV and fc1 inputs h, projection input q = h, fc2 input f;
    # gradients of QKV out 3h, projection out h, fc1 out f, fc2 out h; each element cast
    # costs an amax read (2), a read (2) and two 1-byte writes
    elems = H + H + 3 * H + H + (H + F + F + H)
    assert fp8["FP8 casts"] == pytest.approx(TOKENS * L * elems * 6 / HBM, rel=1e-12)
    # tp 2 with SP: every cast is of the rank's half
    c2 = cfg("--tensor-model-parallel-size 2 --sequence-parallel", world=2)
    assert step_time(c2, cl, 1, 0, features=FP8).terms["FP8 casts"] == \
        pytest.approx(fp8["FP8 casts"] / 2, rel=1e-12)


def test_causal_kernels_compute_half_the_square_and_recompute_it_in_backward():
    c = cfg()
    full = step_time(c, cluster(), 1, 0).terms["compute"]
    skip = step_time(c, cluster(flash_skips_masked=True), 1, 0).terms["compute"]
    attn = 2 * 2 * H  # scores and values per key, per token
    assert full - skip == pytest.approx(TOKENS * L * attn * (S * 3 - S / 2 * 3.5) / RATE16,
                                        rel=1e-9)
    # a window of 16 on half the layers: those attend to 16 keys, the others to s/2
    window = Features(sliding_window=16, sliding_window_share=0.5)
    win = step_time(c, cluster(flash_skips_masked=True), 1, 0, features=window).terms
    keys = 0.5 * S / 2 + 0.5 * 16
    assert skip - win["compute"] == pytest.approx(
        TOKENS * L * attn * 3.5 * (S / 2 - keys) / RATE16, rel=1e-9)


E, K, FM, EP = 8, 2, 64, 4
MOE = (f"--num-experts {E} --moe-router-topk {K} --moe-ffn-hidden-size {FM} "
       f"--moe-token-dispatcher-type alltoall --expert-model-parallel-size {EP}")


def test_grouped_gemm_pays_a_fixed_cost_per_kernel_of_each_local_expert():
    c = cfg(MOE, world=EP)
    rows = K * TOKENS  # balanced: as many rows come in as go out
    flops = rows * 2 * H * FM * 2 * 3  # fc1 + fc2, forward and backward
    local = E // EP
    for feats, rate, kernels in ((Features(), RATE16, 6), (FP8, RATE8, 6 + 8)):
        t = step_time(c, cluster(expert_kernel_overhead_us=50.0), 1, 0, features=feats).terms
        want = L * (flops / rate + local * kernels * 50e-6)
        assert t["MoE grouped GEMM"] == pytest.approx(want, rel=1e-12), feats
    # routed rows' bytes per layer, forward: permute 2h, sort and unsort by local expert 4h,
    # activation 2f, un-permute h + h/k (2-byte elements); the router's fp32 scores 12E per
    # token; backward twice the forward
    per_row = 2 * (2 * H + 4 * H + 2 * FM + H + H / K)
    fwd = rows * per_row + 12 * E * TOKENS
    t = step_time(c, cluster(), 1, 0).terms
    assert t["MoE permute"] == pytest.approx(L * 3 * fwd / HBM, rel=1e-12)


def test_combined_1f1b_hides_each_all_to_all_under_one_piece_of_compute():
    # the forward's dispatch under the experts' backward (2/3), the backward's dispatch
    # gradient under their forward (1/3); the combine likewise under the attention block
    out = overlapped_traffic({"dispatch": 4.0, "combine": 2.0}, dense=3.0, experts=1.5)
    assert out == {"dispatch": (2 - 1.0) + (2 - 0.5), "combine": 0.0}
    # a quarter of the micro-batches unpaired: a quarter of the plain traffic stays
    out = overlapped_traffic({"dispatch": 4.0, "combine": 2.0}, 3.0, 1.5, paired=0.75)
    assert out == {"dispatch": 0.75 * 2.5 + 0.25 * 4.0, "combine": 0.25 * 2.0}


def test_combined_1f1b_step_hides_the_paired_micro_batches_traffic_only():
    # 4 micro-batches without pipelining: F0 alone, (F1 B0) (F2 B1) (F3 B2), B3 alone
    c, cl, mb = cfg(MOE, world=EP), cluster(intra_node_gbps=0.5), 4
    plain = step_time(c, cl, mb, 0).terms
    over = step_time(c, cl, mb, 0, features=Features(moe_ep_overlap=True)).terms
    experts = (plain["MoE grouped GEMM"] + plain["MoE permute"]) / mb
    dense = plain["compute"] / mb
    d, cmb = plain["MoE dispatch"] / mb / 2, plain["MoE combine"] / mb / 2
    hid_d = max(0.0, d - experts * 2 / 3) + max(0.0, d - experts / 3)
    hid_c = max(0.0, cmb - dense * 2 / 3) + max(0.0, cmb - dense / 3)
    assert over["MoE dispatch"] == pytest.approx(mb * (0.75 * hid_d + 0.25 * 2 * d),
                                                 rel=1e-12)
    assert over["MoE combine"] == pytest.approx(mb * (0.75 * hid_c + 0.25 * 2 * cmb),
                                                rel=1e-12)
    assert 0 < over["MoE dispatch"] < plain["MoE dispatch"]
    # one micro-batch: nothing to pair it with, the traffic stays whole
    one = step_time(c, cl, 1, 0, features=Features(moe_ep_overlap=True)).terms
    assert one["MoE dispatch"] == step_time(c, cl, 1, 0).terms["MoE dispatch"]


def test_tp_overlap_exposes_what_outlasts_the_gemms():
    """No latency: with fast links every byte hides under the GEMMs; with slow ones each ring
    step exposes what its chunk takes beyond 1/tp of a GEMM, each bulk collective what it
    takes beyond a whole GEMM."""
    c = cfg("--tensor-model-parallel-size 2 --sequence-parallel", world=2)
    act = 2 * S * B * H
    gemm = TOKENS * LINEAR / 4 / 2 / RATE16  # one GEMM of a linear pair on a TP rank
    for gbps in (0.5, 500.0):  # communication longer, then shorter, than the GEMMs
        cl = cluster(intra_node_gbps=gbps)
        one = (act / 2) / (gbps * 1e9)  # one all-gather's, reduce-scatter's or step's bytes
        plain = step_time(c, cl, 1, 0).terms["tensor parallel"]
        assert plain == pytest.approx(L * 2 * 5 * one, rel=1e-12)  # 3 + 2 calls per pair
        over = step_time(c, cl, 1, 0, features=Features(tp_comm_overlap=True)).terms
        want = 2 * (3 * max(0.0, one - gemm / 2) + 2 * max(0.0, one - gemm))
        assert over["tensor parallel"] == pytest.approx(L * want, rel=1e-12), gbps
        assert (over["tensor parallel"] > 0) == (gbps < 1)


@pytest.mark.parametrize("vocab", [V, 64 * V])
def test_embedding_and_loss_slots_set_the_slowest_stage(vocab):
    """8 slots over pp 4 (6 layers): a middle stage holds 2 layers, the last 1 layer and the
    logits; the slower one sets the micro-batch's time."""
    c = cfg("--pipeline-model-parallel-size 4", world=4, layers=8, vocab=vocab)
    cl = cluster(hbm_gbps=0.0)  # GEMMs only
    layer = TOKENS * 3 * (LINEAR + 2 * 2 * S * H) / RATE16
    logits = TOKENS * 3 * 2 * H * vocab / RATE16
    t = step_time(c, cl, 1, 0, features=Features(embedding_and_loss_slots=True)).terms
    assert t["compute"] == pytest.approx(max(2 * layer, layer + logits), rel=1e-12)
    assert (2 * layer > layer + logits) == (vocab == V)  # both cases are exercised


def test_the_run_flags_set_the_fp8_features_and_what_they_cost():
    """--fp8-format / --fp8-recipe / --first-last-layers-bf16 / --fp8-param-gather are what
    the planner prices: the run's flags reach it through features_from_config alone."""
    cl = cluster()
    bf16 = step_time(cfg(), cl, 1, 0).terms
    tw = step_time(cfg("--fp8-format hybrid --fp8-recipe tensorwise"), cl, 1, 0).terms
    fp8 = step_time(cfg(), cl, 1, 0, features=FP8).terms
    assert tw == fp8  # the flags give what Features(fp8="tensorwise") gives
    # delayed and blockwise cast in one pass: 4 bytes per element instead of 6
    for recipe in ("delayed", "blockwise"):
        t = step_time(cfg(f"--fp8-format hybrid --fp8-recipe {recipe}"), cl, 1, 0).terms
        assert t["FP8 casts"] == pytest.approx(tw["FP8 casts"] * 4 / 6, rel=1e-12)
        assert t["compute"] == tw["compute"]
    # the first and last layer stay 16-bit: half the layers' linears at each rate
    half = step_time(cfg("--fp8-format hybrid --fp8-recipe tensorwise "
                         "--first-last-layers-bf16"), cl, 1, 0).terms
    assert half["FP8 casts"] == pytest.approx(tw["FP8 casts"] / 2, rel=1e-12)
    saved = TOKENS * L * 3 * LINEAR * (1 / RATE16 - 1 / RATE8)
    assert bf16["compute"] - half["compute"] == pytest.approx(saved / 2, rel=1e-9)
    z3 = "--zero-stage 3 --no-overlap-grad-reduce"
    gathered = step_time(cfg(f"{z3} --fp8-format hybrid --fp8-recipe tensorwise "
                             "--fp8-param-gather", world=4), cl, 1, 10**6).terms
    assert gathered == step_time(cfg(z3, world=4), cl, 1, 10**6, features=Features(
        fp8="tensorwise", fp8_param_gather=True)).terms


def test_fp8_parameter_gathers_move_a_byte_per_parameter():
    c = cfg("--zero-stage 3 --no-overlap-grad-reduce", world=4)
    cl = cluster(comm_overlaps_compute=False)
    params, dp, bw = 10**6, 4, 300e9
    for feats, gathered in ((Features(), 2), (Features(fp8_param_gather=True), 1)):
        t = step_time(c, cl, 1, params, features=feats).terms
        want = (2 * gathered * params + 2 * params) * (dp - 1) / dp / bw
        assert t["data parallel"] == pytest.approx(want, rel=1e-12), feats


def test_features_are_checked_with_the_name_and_the_fix():
    from megazero.config import ConfigError

    with pytest.raises(ConfigError, match="fp8='mxfp8'"):
        Features(fp8="mxfp8")
    with pytest.raises(ConfigError, match="needs sliding_window"):
        Features(sliding_window_share=0.5)
    assert dataclasses.replace(FP8, fp8=None) == Features()


def test_the_estimator_counts_the_fp8_cast_buffers():
    """One GEMM's FP8 copies at a time, of the largest one: fc2's input (B S x F) and the MLP's
    weight (F x H), each written row- and column-wise, a byte per element; at tp 2 + SP the
    gathered input of QKV (B S x H) is the largest then."""
    from megazero.planner.estimate import FP8_CAST_ITEM, rank_memory

    plain = rank_memory(cfg(), 0, 1, device_is_cpu=True)
    fp8 = rank_memory(cfg("--fp8-format hybrid --fp8-recipe tensorwise"), 0, 1,
                      device_is_cpu=True)
    assert FP8_CAST_ITEM not in plain.items
    assert fp8.items[FP8_CAST_ITEM] == 2 * (B * S * F + F * H)
    assert fp8.device_total - plain.device_total == pytest.approx(2 * (B * S * F + F * H))
    tp2 = rank_memory(cfg("--fp8-format hybrid --tensor-model-parallel-size 2 "
                          "--sequence-parallel", world=2), 0, 1, device_is_cpu=True)
    assert tp2.items[FP8_CAST_ITEM] == 2 * (B * S * max(H, F / 2) + F * H / 2)
