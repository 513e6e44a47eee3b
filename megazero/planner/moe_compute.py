"""What an MoE layer's experts cost on the device besides the dispatcher's communication.

Per MoE layer and micro-batch a rank runs its local experts (``E / ep`` of them) on the rows
the dispatcher brought: with routing balanced, as many as it sent, ``R = k T`` for its ``T``
tokens (:func:`megazero.planner.moe_cost.routed_rows`), ``etp R`` with expert tensor
parallelism (the rows are all-gathered over the ``etp`` group). Two costs:

* **The grouped GEMM** of those rows: ``R`` rows through fc1 (``h -> f`` or ``h -> 2f`` with
  a gated unit) and fc2 (``f -> h``), forward and backward, at the FP8 or 16-bit GEMM rate,
  plus a fixed cost per kernel each local expert runs (``expert_kernel_overhead_us``, an
  assumed number of the cluster): its GEMMs (fc1 and fc2 forward, their input and weight
  gradients: 6, and 2 per recomputed forward) and, in FP8, its casts (each an amax and a cast
  kernel, for the two inputs forward and the two output gradients backward: 8 more). This is
  what makes short expert GEMMs slow: the kernels of a dropless MoE layer are launched only
  once the token counts per expert have reached the host (a device-to-host synchronisation
  per layer), so their launch and host work, one set per expert, is not hidden behind the
  device's queue, and its weight grows as the rows per expert ``M = etp R ep / E`` shrink.
  :func:`grouped_gemm_efficiency` is the resulting share of the GEMM rate.
* **The routed rows' memory traffic**, forward per row, ``e``-byte elements: the permutation
  gathers each token's row into its experts' order (read and write ``h``); with more than one
  local expert behind an all-to-all, the received rows are sorted by local expert and sorted
  back before the combine (``2 x 2h``); the activation reads ``2f`` (gated) or ``f`` and writes
  ``f``; the un-permutation reads each expert output row and adds it, weighted, into its token
  (``h + h / k``); the router writes and normalises fp32 scores (``3 x 4E`` per token).
  Backward moves twice the forward's bytes (as every non-GEMM kernel:
  :data:`megazero.planner.hbm_traffic.BACKWARD_OVER_FORWARD`); a fully recomputed layer adds
  its forward again; FP8 experts cast each routed row's GEMM inputs and output gradients
  (:func:`megazero.planner.fp8_cost.cast_bytes_per_element`).
"""

from __future__ import annotations

from megazero.config import MegazeroConfig
from megazero.planner.cluster import Cluster
from megazero.planner.features import Features
from megazero.planner.hbm_traffic import BACKWARD_OVER_FORWARD


def expert_rows(cfg: MegazeroConfig) -> float:
    """Rows one rank's local experts take per MoE layer and micro-batch (balanced routing)."""
    from megazero.planner.moe_cost import routed_rows

    return float(cfg.layout().etp * routed_rows(cfg))


def local_experts(cfg: MegazeroConfig) -> int:
    moe = cfg.model.moe
    assert moe.num_experts is not None
    return moe.num_experts // cfg.layout().ep


def tokens_per_expert(cfg: MegazeroConfig) -> float:
    """``M``: rows each local expert's GEMM gets per micro-batch."""
    return expert_rows(cfg) / local_experts(cfg)


def expert_kernels(features: Features, passes: float) -> float:
    """Kernels one local expert runs per MoE layer and micro-batch: 2 GEMMs per forward and 4
    in backward (``passes`` = 3 + the recomputed share), and in FP8 two kernels (amax, cast)
    per input cast: 2 casts per forward, 2 in backward."""
    forwards = passes - 2.0
    gemms = 2 * forwards + 4
    casts = 2 * (2 * forwards + 2) if features.fp8 else 0
    return gemms + casts


def grouped_gemm_efficiency(cfg: MegazeroConfig, cluster: Cluster, features: Features,
                            passes: float = 3.0) -> float:
    """Share of the GEMM rate the experts' grouped GEMM reaches at this run's rows per expert:
    the GEMM time over itself plus the per-kernel overhead of every local expert."""
    flops = _gemm_seconds(cfg, cluster, features, passes)
    return flops / (flops + _overhead_seconds(cfg, cluster, features, passes))


def expert_flops_per_row(cfg: MegazeroConfig) -> float:
    """Forward GEMM FLOPs of one routed row through one expert on this rank (``1/etp`` of the
    expert's width with expert tensor parallelism)."""
    m = cfg.model
    f = m.moe.moe_ffn_hidden_size or m.ffn_size
    glu = 2 if m.swiglu else 1
    return 2.0 * m.hidden_size * f * (glu + 1) / cfg.layout().etp


def routed_row_bytes(cfg: MegazeroConfig, features: Features, passes_fwd: float) -> float:
    """Device-memory bytes of one MoE layer's routed rows and router on one rank per
    micro-batch: forward ``passes_fwd`` times (1, more with recomputation) and backward."""
    m, moe = cfg.model, cfg.model.moe
    assert moe.num_experts is not None
    e = cfg.precision.params_dtype.itemsize
    h = m.hidden_size
    f = (moe.moe_ffn_hidden_size or m.ffn_size) / cfg.layout().etp
    glu = 2 if m.swiglu else 1
    layout = cfg.layout()
    local = moe.num_experts // layout.ep
    sort = 4 * h if layout.ep > 1 and local > 1 else 0
    k = moe.moe_router_topk
    per_row = e * (2 * h + sort + (glu + 1) * f + h + h / k)
    rows = expert_rows(cfg)
    tokens = rows / (layout.etp * k)
    router = 3 * 4 * moe.num_experts * tokens
    fwd = rows * per_row + router
    total = fwd * (passes_fwd + BACKWARD_OVER_FORWARD)
    if features.recompute_norms_and_moe_act:
        total += rows * e * (glu + 1) * f
    if features.fp8:
        from megazero.planner.fp8_cost import cast_bytes_per_element

        total += rows * (h + f + glu * f + h) * cast_bytes_per_element(e, features.fp8)
    return total


def _gemm_seconds(cfg: MegazeroConfig, cluster: Cluster, features: Features,
                  passes: float) -> float:
    flops = expert_rows(cfg) * expert_flops_per_row(cfg) * passes
    return flops / cluster.gemm_rate(cfg.precision.params_dtype.itemsize == 2,
                                     bool(features.fp8))


def _overhead_seconds(cfg: MegazeroConfig, cluster: Cluster, features: Features,
                      passes: float) -> float:
    return (local_experts(cfg) * expert_kernels(features, passes)
            * cluster.expert_kernel_overhead_us * 1e-6)


def grouped_gemm_seconds(cfg: MegazeroConfig, cluster: Cluster, features: Features,
                         passes: float) -> float:
    """Seconds of one MoE layer's expert GEMMs on one rank per micro-batch: ``passes`` times
    the forward FLOPs (3 for forward and backward, more with recomputation) at the FP8 or
    16-bit rate, plus each local expert's kernels at ``expert_kernel_overhead_us``."""
    return (_gemm_seconds(cfg, cluster, features, passes)
            + _overhead_seconds(cfg, cluster, features, passes))
