"""Predicted time of one training iteration, by term, for one layout on one cluster.

* compute: the run's GEMM FLOPs per rank (counted per GEMM: QKV with grouped-query K/V, the
  projection, the MLP with two or three matrices, attention scores and values, the logits;
  x3 for forward + backward, plus one more forward with full recompute, plus the core attention
  forward with selective recompute) at ``achievable_fraction`` of the dense peak;
* pipeline bubble ``(p-1)/(v m)`` of that compute, and the p2p of one activation per micro-batch
  per chunk boundary each way;
* tensor parallel: 4 ring all-reduces (or all-gather + reduce-scatter with SP: the same bytes)
  of ``s b h`` per layer per micro-batch, over NVLink when the TP group fits in a node;
* data parallel: ``2Ψ(N-1)/N`` (stages 0-2) gradient elements per rank
  (:func:`megazero.zero.accounting.formula_comm_bytes`); stage 3 ``(2m+1)Ψ(N-1)/N`` for m
  micro-batches (the paper's ``3Ψ`` is m = 1: parameters are gathered for the forward and the
  backward of every micro-batch); hidden behind the backward (2/3 of compute) with
  ``overlap_comm``;
* offload: gradients down and weights up over PCIe, and CPU Adam on the shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.flops import model_flops_per_iteration
from megazero.planner.cluster import Cluster
from megazero.zero.accounting import formula_comm_bytes


def gemm_flops_per_token(cfg: MegazeroConfig) -> tuple[float, float, float]:
    """(dense layer FLOPs, core-attention FLOPs, logits FLOPs) of one token's forward."""
    m = cfg.model
    h, s, f = m.hidden_size, m.seq_length, m.ffn_size
    kv = m.query_groups * m.head_dim
    dense = 2 * (h * (h + 2 * kv) + h * h + (3 if m.swiglu else 2) * h * f)
    attn = 2 * 2 * s * h
    return dense * m.num_layers, attn * m.num_layers, 2 * h * m.vocab_size


@dataclass
class StepTime:
    terms: dict[str, float] = field(default_factory=dict)  # seconds, exposed
    model_flops: float = 0.0
    tokens: int = 0
    world: int = 1
    peak: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.world * self.peak) if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"step_time_s": self.seconds, "time_terms_s": self.terms,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "model_flops_per_iteration": self.model_flops}


def _ring_seconds(nbytes: float, n: int, gbps: float, latency_s: float, factor: float) -> float:
    if n <= 1:
        return 0.0
    return factor * nbytes * (n - 1) / n / (gbps * 1e9) + latency_s


def step_time(cfg: MegazeroConfig, cluster: Cluster, num_microbatches: int,
              params_per_rank: int, zero3_units: int = 0) -> StepTime:
    """``zero3_units``: stage-3 gather units on the rank (each is gathered in forward and in
    backward and reduce-scattered once per micro-batch: latency-bound when units are small)."""
    p, z, m = cfg.parallel, cfg.zero, cfg.model
    layout = cfg.layout()
    tp, pp, dp, vpp = p.tp, p.pp, layout.dp, cfg.vpp or 1
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    mb = num_microbatches
    gbs = b * dp * mb
    e = cfg.precision.params_dtype.itemsize
    sixteen = e == 2
    peak = cluster.peak_flops(sixteen)
    lat = cluster.per_collective_latency_us * 1e-6
    node = cluster.gpus_per_node
    out = StepTime(tokens=gbs * s, world=layout.world_size, peak=peak)
    dense, attn, logits = gemm_flops_per_token(cfg)
    fwd_tokens = 3.0
    extra = 0.0
    rc = p.recompute
    if rc.granularity == "full":
        extra = dense + attn
    elif rc.granularity == "selective":
        extra = attn  # the core attention forward again
    per_token = fwd_tokens * (dense + attn + logits) + extra
    flops_rank = per_token * gbs * s / (tp * pp * dp)
    compute = flops_rank / (peak * cluster.achievable_fraction)
    compute += cluster.per_layer_overhead_us * 1e-6 * 3 * m.num_layers / pp * mb
    compute += cluster.per_microbatch_overhead_us * 1e-6 * mb * vpp
    out.terms["compute"] = compute
    if pp > 1:
        out.terms["pipeline bubble"] = compute * (pp - 1) / (vpp * mb)
        cross = tp * dp >= node and layout.world_size > node
        act = e * s * b * h / (tp if sequence_parallel_active(p.sequence_parallel, tp) else 1)
        bw = cluster.inter_node_gbps if cross else cluster.intra_node_gbps
        out.terms["pipeline p2p"] = 2 * mb * vpp * (act / (bw * 1e9) + lat)
    if tp > 1:
        bw = cluster.intra_node_gbps if tp <= node else cluster.inter_node_gbps
        per = _ring_seconds(e * s * b * h, tp, bw, lat, 2.0)
        out.terms["tensor parallel"] = 4 * per * (m.num_layers / pp) * mb
    if dp > 1:
        bw = cluster.intra_node_gbps if tp * dp <= node else cluster.inter_node_gbps
        gs = e
        moved = formula_comm_bytes(z.stage, params_per_rank, dp, gs)
        if z.stage == 3:  # parameters are gathered again in every micro-batch's fwd and bwd
            moved *= (2 * mb + 1) / 3
        comm = moved / (bw * 1e9) + lat * max(1, params_per_rank // max(1, z.reduce_bucket_size))
        if z.overlap_comm:
            comm = max(0.0, comm - compute * 2 / 3)
        out.terms["data parallel"] = comm
        if z.stage == 3:
            out.terms["ZeRO-3 gather latency"] = 3 * zero3_units * mb * lat
    if z.offload_optimizer.enabled or (z.stage == 3 and z.offload_param.enabled):
        shard = params_per_rank / (dp if z.stage else 1)
        out.terms["offload PCIe"] = shard * (e + e) / (cluster.pcie_gbps * 1e9)
        out.terms["CPU Adam"] = shard / (cluster.cpu_adam_gparams_per_s * 1e9)
    # Megatron's formula (72 B s l h^2 ...) for MFU, so the number compares with papers
    out.model_flops = model_flops_per_iteration(gbs, s, m.num_layers, h, m.vocab_size)
    return out
