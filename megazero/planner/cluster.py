"""Cluster descriptions as data: per-device memory and peak FLOP/s, links, host.

Built-in descriptions are JSON files next to this module (``clusters/<name>.json``); a user
passes the path of their own file with the same keys. Bandwidths are per device and
unidirectional, in GB/s (10^9 bytes): ``intra_node_gbps`` (NVLink: TP and in-node traffic),
``inter_node_gbps`` (network: DP/PP traffic that leaves the node: each device's share of its
node's NICs, one 200 Gb/s HDR port per GPU on a DGX A100; a group with k ranks on a node
uses k of them), ``pcie_gbps`` (offload), ``hbm_gbps`` (device memory). ``sources`` says
where each number comes from.
``achievable_fraction`` is the fraction of the dense peak that large GEMMs reach (stated, not
measured here). ``cpu.json`` describes gloo ranks on a 2-core CI machine; its constants come
from micro-benchmarks on that machine (bench/cpu_calibration.py: a GEMM rate, one layer's
forward + backward, per-layer and per-micro-batch overheads of a tiny model, gloo collectives
at 4 KiB-16 MiB, an AdamW step), none of them a layout that bench/estimator_vs_measured.py
ranks; its ``gemm_half_rate_rows`` from bench/chunked_gemm.py (fp32, one thread:
bench/results/chunked_gemm_cpu.json). The GPU descriptions' ``gemm_half_rate_rows`` is an
assumption until bench/chunked_gemm.py has run on that GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from megazero.config import ConfigError

CLUSTER_DIR = Path(__file__).parent / "clusters"


@dataclass(frozen=True)
class Cluster:
    name: str
    device: str
    memory_gb: float
    peak_tflops_16: float
    peak_tflops_32: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    pcie_gbps: float
    host_memory_gb: float
    cpu_adam_gparams_per_s: float
    achievable_fraction: float
    per_collective_latency_us: float = 10.0
    per_layer_overhead_us: float = 0.0
    per_microbatch_overhead_us: float = 0.0  # launch / Python cost of one chunk's fwd + bwd
    # False where the collectives' copies and reductions run on the cores that compute (gloo
    # ranks filling a CPU): no communication hides behind the backward
    comm_overlaps_compute: bool = True
    # the optimizer step on the device, parameters per second (0: not charged, as on GPUs
    # where it is a few milliseconds)
    device_adam_gparams_per_s: float = 0.0
    # measured cost per collective kind (all_reduce, all_gather, reduce_scatter, send_recv,
    # all_to_all):
    # [alpha microseconds per call, GB/s of ring wire bytes]; replaces the link bandwidths and
    # ``per_collective_latency_us`` for the kinds it names
    collectives: dict[str, list[float]] | None = None
    # how much faster a rank computes while the other ranks of its node idle (1 where every
    # rank has its own device; more on a CPU whose ranks share cores and memory bandwidth):
    # the pipeline's warm-up and cool-down run at that speed
    solo_speedup: float = 1.0
    # a layer's non-GEMM time (norms, dropout, residuals, softmax) as a share of its GEMM time
    # at tp = 1, charged apart from ``achievable_fraction``: tensor parallelism without SP
    # repeats it on every TP rank, SP splits it (0: folded into ``achievable_fraction``)
    nongemm_share: float = 0.0
    # device memory bandwidth, GB/s: where given, the non-GEMM kernels cost the bytes they
    # move (megazero.planner.hbm_traffic) instead of ``nongemm_share``, and the optimizer
    # step the bytes it streams (unless ``device_adam_gparams_per_s`` is given)
    hbm_gbps: float = 0.0
    # FP8 tensor-core peak (dense, TFLOP/s) and the share of it FP8 GEMMs reach: the FP8
    # counterpart of peak_tflops_16 and achievable_fraction (0: no FP8, the 16-bit rate)
    peak_tflops_fp8: float = 0.0
    achievable_fraction_fp8: float = 0.0
    # fused attention kernels skip the key blocks a causal mask removes entirely (half the
    # score FLOPs) and recompute the scores in backward (2.5x the forward's FLOPs), as
    # FlashAttention-2/3 and cuDNN's fused attention do; False: the whole square, 2x backward
    flash_skips_masked: bool = False
    # fixed cost of each kernel an MoE layer runs per local expert (its GEMMs and FP8 casts),
    # microseconds: launch and host work a dropless dispatcher's synchronisation leaves
    # exposed (megazero.planner.moe_compute; 0: none)
    expert_kernel_overhead_us: float = 0.0
    # the rows ``M0`` at which a GEMM runs at half the rate of a very tall one: one of ``M``
    # rows takes time proportional to ``M + M0``, so ``--tp-comm-overlap``'s ``tp`` sequence
    # chunks of a GEMM take ``(M + tp M0) / (M + M0)`` of its whole time
    # (megazero.planner.tp_cost.overlap_chunking_seconds; bench/chunked_gemm.py measures and
    # fits it; 0: chunking costs nothing)
    gemm_half_rate_rows: float = 0.0
    # where each number comes from (datasheets, measurements): documentation, not used
    sources: dict[str, str] | None = None

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def peak_flops(self, sixteen_bit: bool) -> float:
        return (self.peak_tflops_16 if sixteen_bit else self.peak_tflops_32) * 1e12

    def gemm_rate(self, sixteen_bit: bool, fp8: bool = False) -> float:
        """FLOP/s a training step's GEMMs reach: the FP8 peak times its fraction for FP8
        GEMMs (on a cluster that states them), else the 16- or 32-bit peak times
        ``achievable_fraction``."""
        if fp8 and self.peak_tflops_fp8:
            return self.peak_tflops_fp8 * 1e12 * self.achievable_fraction_fp8
        return self.peak_flops(sixteen_bit) * self.achievable_fraction


def builtin_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.json"))


def load_cluster(name_or_path: str) -> Cluster:
    """A built-in name (``h100-80gb-nvlink``, ``a100-80gb``...) or a JSON file path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CLUSTER_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ConfigError(f"--cluster {name_or_path!r}: unknown cluster; use one of "
                              f"{builtin_clusters()} or the path of a JSON file with the keys "
                              f"{[f.name for f in fields(Cluster)]}")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--cluster {name_or_path}: cannot read it as JSON ({exc})") from exc
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"--cluster {path}: unknown keys {unknown}; expected {sorted(known)}")
    data.setdefault("name", path.stem)
    try:
        return Cluster(**data)
    except TypeError as exc:
        raise ConfigError(f"--cluster {path}: {exc}; expected keys {sorted(known)}") from exc


def planning_argv(argv: list[str], cluster: Cluster) -> list[str]:
    """``argv`` as the run would read it on ``cluster``: a GPU cluster's runs use NCCL, whose
    defaults (Megatron's overlap and bucket sizes) differ from gloo's, so a plan made on a CPU
    machine must not take this machine's backend."""
    given = {a.split("=")[0] for a in argv}
    if cluster.name == "cpu" or "--distributed-backend" in given:
        return argv
    return [*argv, "--distributed-backend", "nccl"]
