"""What the MoE token dispatcher's communication costs in the step-time model.

Per MoE layer and micro-batch, a rank routes its own ``T = b s / tp`` tokens (sequence
parallelism splits them over TP) to the experts of its expert-parallel group of ``ep`` ranks
(:mod:`megazero.moe.token_dispatcher`):

* ``alltoall``: forward all-gathers the per-expert counts (``ep x E`` int64) and sends the
  ``R`` routed rows (``R = k T`` dropless, balanced; ``E x capacity`` padded to capacity) of
  ``h`` activations out to the experts' ranks and back (dispatch + combine: two
  ``all_to_all_single`` calls, ``(ep-1)/ep`` of ``R h`` bytes each); backward sends the
  gradients along the same two routes. Counted at the average: routing balanced over ranks.
* ``allgather``: forward all-gathers the tokens (``ep T h``), the fp32 probabilities and the
  routing map (``ep T E``, 4 and 1 bytes) and reduce-scatters the experts' sums (``ep T h``);
  backward reduce-scatters the tokens' and probabilities' gradients and all-gathers the
  output's.

* expert tensor parallelism (``etp`` > 1, :mod:`megazero.moe.expert_tp`): the ``R`` rows a
  rank's experts receive are all-gathered over the ``etp`` group before the experts and the
  partial outputs reduce-scattered after them (``etp R h`` each), and the reverse in backward.

A fully recomputed layer runs its forward, collectives included, a second time. Nothing here
overlaps compute (the experts wait for their rows). Links: the expert grid orders ranks
``etp`` fastest, then ``ep``, so the group is inside a node when ``etp x ep`` fits one; across
nodes a ring collective runs over the group's NICs on each node
(:func:`megazero.planner.step_time.dp_link_gbps`), and an all-to-all sends its rows to the
peers on the node over NVLink and the others over the rank's NIC at the same time (the slower
of the two sets the time).

The experts' GEMM FLOPs (``k`` active experts per token, the router and any shared expert) are
in the compute term (:func:`megazero.planner.step_time.gemm_flops_per_token`).
"""

from __future__ import annotations

from megazero.config import MegazeroConfig
from megazero.planner.cluster import Cluster


def moe_layers(cfg: MegazeroConfig) -> int:
    """How many of the model's layers are MoE layers."""
    m = cfg.model
    if m.moe.num_experts is None:
        return 0
    return sum(m.moe.is_moe_layer(i, m.num_layers) for i in range(m.num_layers))


def routed_rows(cfg: MegazeroConfig) -> int:
    """Rows one rank sends through its experts per MoE layer and micro-batch: ``k T``, or
    ``E x capacity`` when inputs are padded to capacity (capacity over the micro-batch)."""
    from megazero.moe.moe_utils import expert_capacity

    m, moe = cfg.model, cfg.model.moe
    assert moe.num_experts is not None
    tokens = cfg.train.micro_batch_size * m.seq_length
    if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor is not None:
        return moe.num_experts * expert_capacity(tokens, moe.num_experts, moe.moe_router_topk,
                                                 moe.moe_expert_capacity_factor)
    return moe.moe_router_topk * tokens // cfg.parallel.tp


def dispatcher_collectives(cfg: MegazeroConfig) -> list[tuple[str, float]]:
    """``(kind, buffer bytes)`` of each collective one MoE layer issues per micro-batch,
    forward (twice with full recompute) and backward. The buffer is what
    :func:`megazero.planner.step_time.wire_bytes` takes: the gathered (or reduce-scattered)
    whole for ring collectives, the rank's send buffer for an all-to-all."""
    m, moe = cfg.model, cfg.model.moe
    layout = cfg.layout()
    ep, e, h = layout.ep, cfg.precision.params_dtype.itemsize, m.hidden_size
    if moe.num_experts is None or ep == 1:
        return []
    experts = moe.num_experts
    fwd_passes = 2 if cfg.parallel.recompute.granularity == "full" else 1
    if moe.moe_token_dispatcher_type == "alltoall":
        rows = routed_rows(cfg) * h * e
        fwd = [("all_gather", 8.0 * ep * experts), ("all_to_all", rows), ("all_to_all", rows)]
        bwd = [("all_to_all", rows), ("all_to_all", rows)]
    else:
        tokens = ep * cfg.train.micro_batch_size * m.seq_length // cfg.parallel.tp
        act = float(tokens * h * e)
        fwd = [("all_gather", act), ("all_gather", 4.0 * tokens * experts),
               ("all_gather", 1.0 * tokens * experts), ("reduce_scatter", act)]
        bwd = [("reduce_scatter", act), ("reduce_scatter", 4.0 * tokens * experts),
               ("all_gather", act)]
    return fwd * fwd_passes + bwd


def expert_tp_collectives(cfg: MegazeroConfig) -> list[tuple[str, float]]:
    """``(kind, buffer bytes)`` of the expert-tensor-parallel gather and reduce-scatter of one
    MoE layer per micro-batch (forward, twice with full recompute, and backward)."""
    moe, etp = cfg.model.moe, cfg.layout().etp
    if moe.num_experts is None or etp == 1:
        return []
    rows = float(etp * routed_rows(cfg) * cfg.model.hidden_size
                 * cfg.precision.params_dtype.itemsize)
    fwd_passes = 2 if cfg.parallel.recompute.granularity == "full" else 1
    return [("all_gather", rows), ("reduce_scatter", rows)] * (fwd_passes + 1)


def all_to_all_seconds(cluster: Cluster, nbytes: float, ep: int, etp: int) -> float:
    """One all-to-all of a ``nbytes`` send buffer over an expert-parallel group: each peer
    gets ``nbytes / ep``; peers on the node over NVLink, the others over the rank's NIC share
    (both at once). A measured ``all_to_all`` entry in the cluster's table replaces this."""
    from megazero.planner.links import alpha_beta, wire_bytes

    measured = (cluster.collectives or {}).get("all_to_all")
    alpha, beta = alpha_beta(cluster, "all_to_all", cluster.intra_node_gbps)
    if measured is not None or etp * ep <= cluster.gpus_per_node:
        return alpha + wire_bytes("all_to_all", nbytes, ep) / beta
    local = max(1, min(ep, cluster.gpus_per_node // etp))  # group members on this node
    on_node = nbytes * (local - 1) / ep / (cluster.intra_node_gbps * 1e9)
    off_node = nbytes * (ep - local) / ep / (cluster.inter_node_gbps * 1e9)
    return alpha + max(on_node, off_node)


def moe_dispatch_seconds(cfg: MegazeroConfig, cluster: Cluster) -> float:
    """Seconds of one micro-batch's dispatcher traffic over the MoE layers of the slowest
    pipeline stage (its share ``1/pp`` of them)."""
    from megazero.planner.links import collective_seconds, dp_link_gbps

    layout = cfg.layout()
    ep, etp = layout.ep, layout.etp
    ring_bw = dp_link_gbps(cluster, etp, ep)  # ranks ordered etp fastest, then ep
    per_layer = 0.0
    for kind, nbytes in dispatcher_collectives(cfg):
        if kind == "all_to_all":
            per_layer += all_to_all_seconds(cluster, nbytes, ep, etp)
        else:
            per_layer += collective_seconds(cluster, kind, nbytes, ep, ring_bw)
    etp_bw = dp_link_gbps(cluster, 1, etp)  # neighbouring ranks
    for kind, nbytes in expert_tp_collectives(cfg):
        per_layer += collective_seconds(cluster, kind, nbytes, etp, etp_bw)
    return per_layer * moe_layers(cfg) / cfg.parallel.pp
