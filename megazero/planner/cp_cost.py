"""What context parallelism costs and saves in the step-time model.

Per layer and micro-batch, a CP rank moves K/V (``2 s_l b (g d) / tp`` elements, ``s_l`` its
share of the sequence) around its group, by comm type (``megazero.context_parallel``):

* ``p2p`` (ring): forward ``CP-1`` hops of K/V; backward ``CP-1`` hops of K/V and ``CP`` hops
  of their fp32 gradient. Each hop is hidden behind the block computed meanwhile, so only what
  exceeds the core-attention compute is exposed.
* ``all_gather``: forward and backward all-gather K/V (``CP-1`` shares each), backward
  reduce-scatters the fp32 dK/dV of the whole sequence; not overlapped.
* ``a2a`` (Ulysses): forward Q, K, V and the output through an all-to-all, backward the same;
  not overlapped.

A full-recompute layer runs its forward (and its traffic) twice. CP ranks are neighbours after
TP in the rank order, so the group is inside a node when ``tp x cp`` fits one.
"""

from __future__ import annotations

from megazero.config import MegazeroConfig
from megazero.planner.cluster import Cluster


def kv_traffic_bytes(cfg: MegazeroConfig) -> dict[str, float]:
    """Bytes one rank sends per layer and micro-batch, ``{"forward": .., "backward": ..}``."""
    m, p = cfg.model, cfg.parallel
    cp, tp = p.cp, p.tp
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    e = cfg.precision.params_dtype.itemsize
    s, b = m.seq_length // cp, cfg.train.micro_batch_size
    kv = 2 * s * b * m.query_groups * m.head_dim / tp  # K and V elements on this rank
    fwd_passes = 2 if p.recompute.granularity == "full" else 1
    if p.cp_comm_type == "p2p":
        fwd, bwd = (cp - 1) * kv * e, (cp - 1) * kv * e + cp * kv * 4
    elif p.cp_comm_type == "all_gather":
        fwd, bwd = (cp - 1) * kv * e, (cp - 1) * kv * e + (cp - 1) * kv * 4
    else:
        q_out = 2 * s * b * m.hidden_size / tp
        fwd = bwd = (q_out + kv) * e * (cp - 1) / cp
    return {"forward": fwd * fwd_passes, "backward": bwd}


def cp_seconds(cfg: MegazeroConfig, cluster: Cluster, attention_seconds: float) -> float:
    """Exposed seconds of one micro-batch's K/V traffic over all of a stage's layers.
    ``attention_seconds``: the stage's core-attention compute for that micro-batch (forward +
    backward), which ring attention's transfers overlap."""
    from megazero.planner.links import alpha_beta

    p = cfg.parallel
    if p.cp == 1:
        return 0.0
    node = cluster.gpus_per_node
    bw = cluster.intra_node_gbps if p.tp * p.cp <= node else cluster.inter_node_gbps
    per_layer = sum(kv_traffic_bytes(cfg).values())  # bytes this rank sends
    layers = cfg.model.num_layers / p.pp
    if p.cp_comm_type == "p2p":
        alpha, beta = alpha_beta(cluster, "send_recv", bw)
        calls = 3 * (p.cp - 1) + 1
        return max(0.0, layers * (calls * alpha + per_layer / beta) - attention_seconds)
    alpha, beta = alpha_beta(cluster, "all_gather", bw)
    calls = 3 if p.cp_comm_type == "all_gather" else 8
    return layers * (calls * alpha + per_layer / beta)
