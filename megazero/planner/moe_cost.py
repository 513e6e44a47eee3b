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
overlaps compute (the experts wait for their rows) unless the run overlaps one micro-batch's
all-to-alls with another's compute (:attr:`megazero.planner.features.Features.moe_ep_overlap`,
priced in :mod:`megazero.planner.step_time` with :func:`overlapped_traffic` for the share of
the micro-batches the schedule pairs, :func:`paired_share`). The traffic is reported in two
parts: the dispatch (the rows to the experts in forward, and their gradients back in
backward) and the combine (the experts' outputs back, and their gradients out). Links: the
expert grid orders ranks ``etp`` fastest, then ``ep``, so the group is inside a node when
``etp x ep`` fits one; across nodes a ring collective runs over the group's NICs on each node
(:func:`megazero.planner.step_time.dp_link_gbps`), and an all-to-all sends its rows to the
peers on the node over NVLink and the others over the rank's NIC at the same time (the slower
of the two sets the time).

The experts' GEMM FLOPs (``k`` active experts per token, the router and any shared expert) are
in the compute term (:func:`megazero.planner.step_time.gemm_flops_per_token`).
"""

from __future__ import annotations

import functools

from megazero.config import MegazeroConfig
from megazero.pipeline.combined import pair_count
from megazero.pipeline.zero_bubble import schedule_steps
from megazero.planner.cluster import Cluster


def moe_layers(cfg: MegazeroConfig) -> int:
    """How many of the model's layers are MoE layers."""
    m = cfg.model
    if m.moe.num_experts is None:
        return 0
    return sum(m.moe.is_moe_layer(i, m.num_layers) for i in range(m.num_layers))


def routed_rows(cfg: MegazeroConfig) -> int:
    """Rows one rank sends through its experts per MoE layer and micro-batch: ``k T`` for its
    ``T`` tokens (``b s / (cp tp)``: context and sequence parallelism split them), or
    ``E x capacity`` when inputs are padded to capacity (capacity over the micro-batch)."""
    from megazero.moe.moe_utils import expert_capacity

    m, moe = cfg.model, cfg.model.moe
    assert moe.num_experts is not None
    tokens = cfg.train.micro_batch_size * m.seq_length // cfg.parallel.cp
    if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor is not None:
        return moe.num_experts * expert_capacity(tokens, moe.num_experts, moe.moe_router_topk,
                                                 moe.moe_expert_capacity_factor)
    return moe.moe_router_topk * tokens // cfg.parallel.tp


def _forward_passes(cfg: MegazeroConfig) -> float:
    """A layer's forward runs once, and again for the recomputed share of the layers."""
    from megazero.planner.activations import recomputed_share

    return 1.0 + recomputed_share(cfg)


#: what each dispatcher collective belongs to: bringing the rows to the experts, or back
DISPATCH, COMBINE = "dispatch", "combine"


def dispatcher_collectives(cfg: MegazeroConfig) -> list[tuple[str, float, str, float]]:
    """``(kind, buffer bytes, role, times)`` of each collective one MoE layer issues per
    micro-batch: forward (``times`` counts the recomputed forward) and backward, ``role``
    :data:`DISPATCH` (the forward's dispatch and its gradient) or :data:`COMBINE`. The buffer
    is what :func:`megazero.planner.links.wire_bytes` takes: the gathered (or
    reduce-scattered) whole for ring collectives, the rank's send buffer for an all-to-all."""
    m, moe = cfg.model, cfg.model.moe
    layout = cfg.layout()
    ep, e, h = layout.ep, cfg.precision.params_dtype.itemsize, m.hidden_size
    if moe.num_experts is None or ep == 1:
        return []
    experts = moe.num_experts
    fwd = _forward_passes(cfg)
    if moe.moe_token_dispatcher_type == "alltoall":
        rows = float(routed_rows(cfg) * h * e)
        return [("all_gather", 8.0 * ep * experts, DISPATCH, fwd),
                ("all_to_all", rows, DISPATCH, fwd), ("all_to_all", rows, COMBINE, fwd),
                ("all_to_all", rows, COMBINE, 1.0), ("all_to_all", rows, DISPATCH, 1.0)]
    tokens = ep * cfg.train.micro_batch_size * m.seq_length // (cfg.parallel.tp
                                                                * cfg.parallel.cp)
    act = float(tokens * h * e)
    return [("all_gather", act, DISPATCH, fwd), ("all_gather", 4.0 * tokens * experts,
                                                 DISPATCH, fwd),
            ("all_gather", 1.0 * tokens * experts, DISPATCH, fwd),
            ("reduce_scatter", act, COMBINE, fwd), ("reduce_scatter", act, DISPATCH, 1.0),
            ("reduce_scatter", 4.0 * tokens * experts, DISPATCH, 1.0),
            ("all_gather", act, COMBINE, 1.0)]


def expert_tp_collectives(cfg: MegazeroConfig) -> list[tuple[str, float, str, float]]:
    """``(kind, buffer bytes, role, times)`` of the expert-tensor-parallel gather (dispatch)
    and reduce-scatter (combine) of one MoE layer per micro-batch, forward and backward."""
    moe, etp = cfg.model.moe, cfg.layout().etp
    if moe.num_experts is None or etp == 1:
        return []
    rows = float(etp * routed_rows(cfg) * cfg.model.hidden_size
                 * cfg.precision.params_dtype.itemsize)
    fwd = _forward_passes(cfg)
    return [("all_gather", rows, DISPATCH, fwd), ("reduce_scatter", rows, COMBINE, fwd),
            ("all_gather", rows, COMBINE, 1.0), ("reduce_scatter", rows, DISPATCH, 1.0)]


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


def moe_traffic_seconds(cfg: MegazeroConfig, cluster: Cluster) -> dict[str, float]:
    """Seconds of one micro-batch's dispatcher traffic over the MoE layers of the slowest
    pipeline stage (its share ``1/pp`` of them), ``{"dispatch": .., "combine": ..}``."""
    from megazero.planner.links import collective_seconds, dp_link_gbps

    layout = cfg.layout()
    ep, etp = layout.ep, layout.etp
    ring_bw = dp_link_gbps(cluster, etp, ep)  # ranks ordered etp fastest, then ep
    out = {DISPATCH: 0.0, COMBINE: 0.0}
    for kind, nbytes, role, times in dispatcher_collectives(cfg):
        if kind == "all_to_all":
            out[role] += times * all_to_all_seconds(cluster, nbytes, ep, etp)
        else:
            out[role] += times * collective_seconds(cluster, kind, nbytes, ep, ring_bw)
    etp_bw = dp_link_gbps(cluster, 1, etp)  # neighbouring ranks
    for kind, nbytes, role, times in expert_tp_collectives(cfg):
        out[role] += times * collective_seconds(cluster, kind, nbytes, etp, etp_bw)
    layers = moe_layers(cfg) / cfg.parallel.pp
    return {k: v * layers for k, v in out.items()}


def overlapped_traffic(traffic: dict[str, float], dense: float, experts: float,
                       paired: float = 1.0) -> dict[str, float]:
    """What stays exposed of ``traffic`` (``{"dispatch", "combine"}`` seconds, forward and
    backward halves alike) under megatron-core's combined 1F1B, which runs one micro-batch's
    forward beside another's backward, layer by layer, each all-to-all under one piece of the
    other's compute: the forward dispatch under the experts' backward, the forward combine
    under the attention's backward, the backward's combine gradient under the attention's
    forward and its dispatch gradient under the experts' forward. ``dense`` and ``experts``:
    the attention block's and the MoE block's compute (forward + backward, a backward being
    2/3 of it), over the same layers as the traffic. ``paired``: the share of the forwards
    (and as many backwards) the schedule pairs (:func:`paired_share`); the others run alone,
    their traffic exposed."""
    d, c = traffic[DISPATCH] / 2, traffic[COMBINE] / 2
    hidden = {DISPATCH: max(0.0, d - experts * 2 / 3) + max(0.0, d - experts / 3),
              COMBINE: max(0.0, c - dense * 2 / 3) + max(0.0, c - dense / 3)}
    return {k: paired * hidden[k] + (1.0 - paired) * traffic[k] for k in hidden}


def paired_share(pp: int, vpp: int | None, num_microbatches: int,
                 schedule: str | None = None, group_size: int | None = None) -> float:
    """The share of a rank's chunk-forwards, and of its chunk-backwards (a pair holds one of
    each), that the combined 1F1B runs beside another micro-batch's backward or forward, on
    the rank with the fewest pairs (its exposed all-to-alls set the pace), counted in the
    steps the executor runs (:func:`megazero.pipeline.zero_bubble.schedule_steps` with
    ``combined``, :func:`megazero.pipeline.combined.pair_count`):

    * no pipelining: F0, (F1, B0), ..., (F m-1, B m-2), B m-1: ``(m - 1) / m``;
    * interleaved (one chunk-forward more of warm-up than 1F1B's): the steady state;
    * DualPipeV: its F&B units;
    * other schedules (1F1B, ZB-H1, ZBV) do not run the combined 1F1B: 0."""
    v = 2 if schedule == "dualpipev" else vpp or 1  # the V: two chunks per rank
    if pp > 1 and not (schedule == "dualpipev"
                       or (v > 1 and schedule in (None, "interleaved"))):
        return 0.0
    return _paired(pp, v if pp > 1 else 1, num_microbatches,
                   schedule if schedule == "dualpipev" else None, group_size)


@functools.lru_cache(maxsize=128)
def _paired(pp: int, vpp: int, m: int, schedule: str | None, group_size: int | None) -> float:
    return min(pair_count(schedule_steps(pp, vpp if vpp > 1 else None, m, r,
                                         group_size=group_size, schedule=schedule,
                                         combined=True))
               for r in range(pp)) / (vpp * m)


def shared_expert_overlapped(traffic: dict[str, float], shared_forward: float
                             ) -> dict[str, float]:
    """What stays exposed of ``traffic`` with ``--moe-shared-expert-overlap``: the forward
    dispatch (half of the dispatch term) less the shared experts' forward
    (``shared_forward`` seconds over the same layers); the backward and the combine as they
    are."""
    d = traffic[DISPATCH] / 2
    return {DISPATCH: max(0.0, d - shared_forward) + d, COMBINE: traffic[COMBINE]}


def moe_dispatch_seconds(cfg: MegazeroConfig, cluster: Cluster) -> float:
    """All of one micro-batch's dispatcher traffic (dispatch and combine) on the slowest
    stage."""
    return sum(moe_traffic_seconds(cfg, cluster).values())
