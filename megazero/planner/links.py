"""What a collective costs on a cluster's links: the alpha-beta model of one call
(:func:`collective_seconds`), the bytes a ring sends (:func:`wire_bytes`), and the bandwidth a
data-parallel ring gets (:func:`dp_link_gbps`). The step-time model and its context- and
expert-parallel terms (:mod:`.cp_cost`, :mod:`.moe_cost`) all price communication here."""

from __future__ import annotations

from megazero.planner.cluster import Cluster

RING = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def alpha_beta(cluster: Cluster, kind: str, gbps: float) -> tuple[float, float]:
    """(seconds per call, wire bytes per second) of one collective kind: the cluster's measured
    ``collectives`` table where it names ``kind``, else ``per_collective_latency_us`` and the
    link's ``gbps``."""
    measured = (cluster.collectives or {}).get(kind)
    if measured is not None:
        return measured[0] * 1e-6, measured[1] * 1e9
    return cluster.per_collective_latency_us * 1e-6, gbps * 1e9


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for a ``nbytes`` buffer over ``n`` ranks in a ring: ``2(n-1)/n`` of
    it for all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter (and for an all-to-all of
    an ``nbytes`` send buffer: the share for the other ranks), all of it for send/recv."""
    return nbytes if kind == "send_recv" else RING[kind] * nbytes * (n - 1) / n


def collective_seconds(cluster: Cluster, kind: str, nbytes: float, n: int, gbps: float) -> float:
    """One collective of a ``nbytes`` buffer over ``n`` ranks: ``alpha + wire / beta``."""
    if n <= 1 and kind != "send_recv":
        return 0.0
    alpha, beta = alpha_beta(cluster, kind, gbps)
    return alpha + wire_bytes(kind, nbytes, n) / beta


def dp_link_gbps(cluster: Cluster, tp: int, dp: int) -> float:
    """Per-rank bandwidth of a data-parallel ring: NVLink inside a node; across nodes, the NICs
    of the group's ranks on each node (ranks are ordered tp fastest, then dp: a group has
    ``node / tp`` ranks on a node when tp < node, each with its share ``inter_node_gbps`` of
    the node's NICs; NCCL runs one ring per NIC), never more than NVLink."""
    node = cluster.gpus_per_node
    if tp * dp <= node:
        return cluster.intra_node_gbps
    per_node = max(1, min(dp, node // tp))
    return min(cluster.intra_node_gbps, per_node * cluster.inter_node_gbps)
