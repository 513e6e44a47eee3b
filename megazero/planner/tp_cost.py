"""Exposed tensor-parallel communication of one column-parallel + row-parallel linear pair under
sequence parallelism, forward and backward, as megazero runs it: plain, and with
``--tp-comm-overlap`` (:mod:`megazero.tensor_parallel.overlap`, every default switch on).

The step-time model prices a transformer layer as two such pairs (attention, MLP), and
``bench/tp_overlap.py`` predicts its measurement with the same function, so the model that the
planner shows a user is the one checked against a measured run.

Plain, each collective waits at once and is exposed whole: the column input's all-gather and
the row output's reduce-scatter in forward (again in a recomputed forward), and in backward the
row output gradient's all-gather, the column input's re-gather for the weight gradient (only
the sequence slice is saved) and the column input gradient's reduce-scatter.

Overlapped, the forward pair and the row backward run as ``tp - 1`` ring steps (one send and
one receive of a ``1/tp`` sequence chunk each) under ``1/tp`` of their GEMM, and the column
backward's re-gather and reduce-scatter run whole under its input- and weight-gradient GEMMs.
A call's fixed cost ``alpha`` stays exposed: it is the issue, the handshake with the peer and
the wake-up at the wait, which happen on the calling thread before and after the GEMM, not
during it; only the bytes move while the GEMM runs, and what they take beyond it is exposed.

The overlap also costs GEMM efficiency (:func:`overlap_chunking_seconds`): three of a pair's
GEMMs per pass (the column and row forward, the row input gradient) run as ``tp`` GEMMs of
``rows / tp`` rows, and a GEMM of ``M`` rows takes time proportional to ``M + M0`` (the
cluster's ``gemm_half_rate_rows``), so ``tp`` chunks take ``M + tp M0`` where the whole GEMM
takes ``M + M0``: ``(tp - 1) M0 / (M + M0)`` of the GEMM's time more. ``bench/chunked_gemm.py``
measures it and fits ``M0``.
"""

from __future__ import annotations

from megazero.planner.cluster import Cluster
from megazero.planner.links import alpha_beta, collective_seconds, wire_bytes


def linear_pair_tp_seconds(cluster: Cluster, act_bytes: float, tp: int, gbps: float,
                           gemm_s: float, overlap: bool, recompute: float = 0.0) -> float:
    """Exposed seconds of one pair's SP collectives on ``act_bytes`` (the full sequence's
    activation), over ``tp`` ranks on ``gbps`` links. ``gemm_s``: one of the pair's GEMMs on a
    rank (forward, input or weight gradient: each has the same FLOPs). ``recompute``: the share
    of forwards run a second time in backward (full recompute: 1)."""
    if tp <= 1:
        return 0.0
    fwd = 1.0 + recompute
    if not overlap:
        ag = collective_seconds(cluster, "all_gather", act_bytes, tp, gbps)
        rs = collective_seconds(cluster, "reduce_scatter", act_bytes, tp, gbps)
        return fwd * (ag + rs) + 2 * ag + rs
    alpha, beta = alpha_beta(cluster, "send_recv", gbps)
    ring = (tp - 1) * (alpha + max(0.0, act_bytes / tp / beta - gemm_s / tp))

    def bulk(kind: str) -> float:
        a, b = alpha_beta(cluster, kind, gbps)
        return a + max(0.0, wire_bytes(kind, act_bytes, tp) / b - gemm_s)

    return fwd * 2 * ring + ring + bulk("all_gather") + bulk("reduce_scatter")


def overlap_chunking_seconds(gemm_s: float, rows: float, tp: int, half_rate_rows: float,
                             recompute: float = 0.0) -> float:
    """Seconds ``--tp-comm-overlap`` adds to one linear pair's GEMMs by splitting them into
    ``tp`` sequence chunks: the column- and row-parallel forward GEMMs (each forward, the
    recomputed one included) and the row-parallel input-gradient GEMM, each of ``rows`` rows
    (the full sequence times the micro-batch) and ``gemm_s`` seconds whole, take
    ``(tp - 1) half_rate_rows / (rows + half_rate_rows)`` of that more; the column backward's
    GEMMs stay whole."""
    chunked = 2 * (1.0 + recompute) + 1
    return chunked * gemm_s * (tp - 1) * half_rate_rows / (rows + half_rate_rows)
