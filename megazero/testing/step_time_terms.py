"""The step-time model on fixed calibration constants, for the tests that check its terms
against formulas written out by hand: a small model (``BASE``), a made-up cluster
(:func:`cluster`) and the terms of one step (:func:`terms`)."""

from __future__ import annotations

from megazero.planner.cluster import Cluster
from megazero.planner.search import _config
from megazero.planner.step_time import step_time

L, H, S, V, B = 4, 64, 32, 128, 2
BASE = (f"--num-layers {L} --hidden-size {H} --num-attention-heads 4 --seq-length {S} "
        f"--vocab-size {V} --tokenizer-type NullTokenizer --global-batch-size 16 "
        f"--micro-batch-size {B}").split()
RATE = 1e10  # FLOP/s reached (peak 2e10 x 0.5)
LAYER_US, MB_US = 100.0, 1000.0
AG, RS, AR, P2P = (50.0, 1.0), (60.0, 0.5), (80.0, 2.0), (20.0, 4.0)  # alpha us, GB/s
PARAMS, UNITS, BUCKETS = 1_000_000, 7, 3


def cluster(**kw) -> Cluster:
    base = dict(name="test", device="cpu", memory_gb=16, peak_tflops_16=0.02,
                peak_tflops_32=0.02, gpus_per_node=8, intra_node_gbps=3.0, inter_node_gbps=1.0,
                pcie_gbps=10.0, host_memory_gb=16, cpu_adam_gparams_per_s=0.1,
                achievable_fraction=0.5, per_collective_latency_us=30.0,
                per_layer_overhead_us=LAYER_US, per_microbatch_overhead_us=MB_US,
                comm_overlaps_compute=False, device_adam_gparams_per_s=0.2,
                collectives={"all_gather": list(AG), "reduce_scatter": list(RS),
                             "all_reduce": list(AR), "send_recv": list(P2P)})
    return Cluster(**{**base, **kw})


def terms(flags: list[str], world: int = 2, cl: Cluster | None = None) -> dict[str, float]:
    cfg = _config(BASE, flags, world)
    dp = cfg.layout().dp
    mb = 16 // (B * dp)
    return step_time(cfg, cl or cluster(), mb, PARAMS, UNITS, BUCKETS).terms
