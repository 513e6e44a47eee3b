"""Predicted time of one training iteration, by term, for one layout on one cluster.

* compute (:mod:`megazero.planner.compute_time`): the slowest pipeline stage's GEMMs per
  micro-batch at the cluster's GEMM rate (FP8 or 16-bit), the core attention, logits and
  router at the 16-bit rate, the non-GEMM kernels at HBM bandwidth (or ``nongemm_share``),
  with FP8 casts (:mod:`megazero.planner.fp8_cost`) and an MoE layer's grouped GEMM and
  routed rows (:mod:`megazero.planner.moe_compute`) as terms of their own; per-layer and
  per-micro-batch overheads;
* pipeline bubble ``(p-1)/(v m)`` of that compute and the communication on each
  micro-batch's path (TP, CP, MoE dispatch) (over the cluster's ``solo_speedup``: the
  working ranks of the warm-up and cool-down may run faster while the others idle), and the
  p2p of one activation per micro-batch per chunk boundary each way (over the stage's NIC when
  the stages sit on different nodes; with Megatron's scatter/gather, 1/tp of it per NIC and an
  all-gather over NVLink);
* MoE (:mod:`megazero.planner.moe_cost`): with expert parallelism the token dispatcher's
  all-to-all (or all-gather + reduce-scatter) per MoE layer, forward and backward, over
  NVLink or the NICs as the expert group sits, as a dispatch and a combine term; with
  :attr:`~megazero.planner.features.Features.moe_ep_overlap` only what exceeds the piece of
  another micro-batch's compute it runs under
  (:func:`megazero.planner.moe_cost.overlapped_traffic`), for the share of the micro-batches
  the schedule pairs (:func:`megazero.planner.moe_cost.paired_share`); MFU then counts the active
  parameters' FLOPs (:func:`megazero.observability.flops.gpt_flops_per_iteration`);
* tensor parallel: 4 ring all-reduces of ``s b h`` per layer per micro-batch, 6 with full
  recompute (the recomputed forward repeats its 2); with SP two column + row linear pairs
  (:mod:`megazero.planner.tp_cost`): per pair an all-gather and a reduce-scatter per forward,
  and in backward two all-gathers (the output gradient, the input re-gathered for the weight
  gradient) and a reduce-scatter; over NVLink when the TP group fits in a node; with
  :attr:`~megazero.planner.features.Features.tp_comm_overlap` the ring steps and bulk
  collectives inside the GEMMs expose each call's latency and the bytes that outlast its GEMM,
  and a term of its own, "TP overlap chunking", charges the GEMM efficiency lost by running
  three of each pair's GEMMs per pass in ``tp`` sequence chunks (the cluster's
  ``gemm_half_rate_rows``; :func:`megazero.planner.tp_cost.overlap_chunking_seconds`);
* data parallel over NVLink inside a node, else over the NICs of the group's ranks on each
  node (:func:`dp_link_gbps`): stage 0 all-reduces, stages 1-2 reduce-scatter + all-gather,
  ``2Ψ(N-1)/N`` bytes per rank in ``ceil(Ψ / reduce_bucket_size)`` calls of each kind (stage
  2 reduce-scatters every micro-batch's gradients: ``(m+1)Ψ(N-1)/N``); stage 3
  ``3mΨ(N-1)/N`` for m micro-batches (the paper's ``3Ψ`` is m = 1: parameters are gathered
  for the forward and the backward of every micro-batch, and its gradients reduce-scattered)
  in two all-gathers per gathered unit and one reduce-scatter per gradient bucket
  (:func:`megazero.zero.stage3_grads.plan_grad_buckets`) per micro-batch, hidden behind
  the backward (2/3 of compute) with ``overlap_comm`` on a cluster whose communication
  overlaps compute; at stages 0-1 gradients accumulate under no_sync, so ``overlap_comm``
  hides their reduction behind the last micro-batch's backward only (stage 2's behind each
  micro-batch's own), and
  ``overlap_param_gather`` the parameters' all-gather behind one micro-batch's forward;
* every collective costs ``alpha + wire bytes / beta`` (:func:`collective_seconds`): alpha and
  beta per kind from the cluster's measured ``collectives`` table, else its latency and links;
* optimizer step on the rank's shard at ``device_adam_gparams_per_s`` (where the cluster gives
  it), else, where it gives ``hbm_gbps``, the bytes a mixed-precision Adam step streams per
  parameter over that bandwidth; with offload, gradients down and weights up over PCIe, and
  CPU Adam on the shard.
"""


from __future__ import annotations

from dataclasses import dataclass, field

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.observability.flops import model_flops_per_iteration
from megazero.pipeline.zero_bubble import ZERO_BUBBLE, bubble_units
from megazero.planner.activations import recomputed_share
from megazero.planner.cluster import Cluster
from megazero.planner.features import Features, features_from_config
from megazero.planner.links import alpha_beta, collective_seconds, dp_link_gbps, wire_bytes


def gemm_flops_per_token(cfg: MegazeroConfig) -> tuple[float, float, float]:
    """(dense layer FLOPs, core-attention FLOPs, logits FLOPs) of one token's forward."""
    from megazero.observability.flops import attention_flops_per_token, moe_mlp_flops_per_token

    m = cfg.model
    h, f = m.hidden_size, m.ffn_size
    weights, attn = attention_flops_per_token(m)  # MLA's latent projections when it is on
    mlp = 2 * (3 if m.swiglu else 2) * h * f
    dense = weights + mlp
    layers = dense * m.num_layers
    if m.moe.num_experts is not None:  # MoE layers: router, k active experts, shared expert
        from megazero.planner.moe_cost import moe_layers

        layers += moe_layers(cfg) * (moe_mlp_flops_per_token(m) - mlp)
    depths = m.mtp_num_layers or 0  # MTP: eh_proj and one layer of the last one's kind each
    if depths:
        last = moe_mlp_flops_per_token(m) if m.moe.is_moe_layer(m.num_layers - 1,
                                                                  m.num_layers) else mlp
        layers += depths * (2 * 2 * h * h + weights + last)
    return layers, attn * (m.num_layers + depths), 2 * h * m.vocab_size * (1 + depths)


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


#: bytes a 16-bit mixed-precision Adam step streams per parameter on the device: 16-bit grad
#: to fp32 (2 + 4), unscale and inf check (4 + 4), grad norm (4), Adam reading master, grad
#: and both moments and writing master and moments (16 + 12), master to 16-bit (4 + 2)
ADAM_BYTES_16 = 52.0
#: fp32 parameters: grad norm (4) and the Adam update (28)
ADAM_BYTES_32 = 32.0


def step_time(cfg: MegazeroConfig, cluster: Cluster, num_microbatches: int,
              params_per_rank: int, zero3_units: int = 0, zero3_buckets: int = 0, *,
              flash: bool = True, p2p_scatter_gather: bool = False,
              features: Features | None = None) -> StepTime:
    """``zero3_units``: stage-3 units gathered on the rank (not the persistent ones; each is
    gathered in forward and in backward of every micro-batch: latency-bound when units are
    small); ``zero3_buckets``: its gradient buckets, each reduce-scattered once per step.
    ``flash``: the core attention keeps no ``s x s`` scores in memory (on clusters with
    ``hbm_gbps``, the softmax then moves no bytes). ``p2p_scatter_gather``: Megatron's
    optimisation for pipelines whose stages sit on different nodes (each TP rank sends 1/tp
    of the activation over its own NIC, the receivers all-gather it over NVLink); megazero
    sends the whole activation from each TP rank unless sequence parallelism splits it.
    ``features``: what the run uses that megazero's training does not have yet (FP8, TP and
    EP overlap, ...; :mod:`megazero.planner.features`), default what ``cfg`` turns on."""
    from megazero.planner.compute_time import microbatch_compute

    feats = features if features is not None else features_from_config(cfg)
    p, z, m = cfg.parallel, cfg.zero, cfg.model
    layout = cfg.layout()
    tp, pp, dp, vpp = p.tp, p.pp, layout.dp, cfg.vpp or 1
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    mb = num_microbatches
    gbs = b * dp * mb
    e = cfg.precision.params_dtype.itemsize
    sixteen = e == 2
    peak = cluster.peak_flops(sixteen)
    node = cluster.gpus_per_node
    out = StepTime(tokens=gbs * s, world=layout.world_size, peak=peak)
    share = recomputed_share(cfg)
    work = microbatch_compute(cfg, cluster, feats, flash)
    per_mb = work.seconds  # every compute term of one micro-batch on the slowest stage
    for name, t in work.terms.items():
        out.terms[name] = t * mb
    compute = per_mb * mb
    stage_layers = m.num_layers / pp
    exposed_per_mb = 0.0  # communication on the micro-batch's critical path
    rdp = dp * p.cp  # ranks holding the same weights: gradients reduce, ZeRO shards over them
    if p.cp > 1:  # K/V traffic; the ring's transfers hide behind the core attention
        from megazero.planner.cp_cost import cp_seconds

        cp_mb = cp_seconds(cfg, cluster, work.attention)
        out.terms["context parallel"] = mb * cp_mb
        exposed_per_mb += cp_mb
        s = s // p.cp  # activations below (pipeline and TP traffic) are the rank's share
    if tp > 1:
        bw = cluster.intra_node_gbps if tp <= node else cluster.inter_node_gbps
        act = e * s * b * h
        # a recomputed layer runs its forward, collectives included, a second time
        if sequence_parallel_active(p.sequence_parallel, tp):
            # two column + row pairs (attention, MLP), each GEMM ~1/4 of the layer's linear
            # FLOPs per pass (:mod:`megazero.planner.tp_cost`)
            from megazero.planner.tp_cost import linear_pair_tp_seconds

            gemm = work.linear_per_layer / (3.0 + share) / 4
            per = 2 * linear_pair_tp_seconds(cluster, act, tp, bw, gemm, feats.tp_comm_overlap,
                                             share)
            if feats.tp_comm_overlap and cluster.gemm_half_rate_rows:
                from megazero.planner.tp_cost import overlap_chunking_seconds

                chunking = 2 * overlap_chunking_seconds(gemm, s * b, tp,
                                                        cluster.gemm_half_rate_rows, share)
                out.terms["TP overlap chunking"] = chunking * stage_layers * mb
                exposed_per_mb += chunking * stage_layers
        else:  # 2 all-reduces per forward (row-parallel outputs), 2 backward (column inputs)
            per = (2 * (1 + share) + 2) * collective_seconds(cluster, "all_reduce", act, tp, bw)
        out.terms["tensor parallel"] = per * stage_layers * mb
        exposed_per_mb += per * stage_layers
    if layout.ep * layout.etp > 1:  # the MoE dispatcher's and the expert tensor group's traffic
        from megazero.planner.moe_cost import moe_traffic_seconds

        traffic = moe_traffic_seconds(cfg, cluster)
        if feats.moe_ep_overlap:  # under another micro-batch's compute, piece by piece,
            # for the forwards and backwards the schedule pairs
            from megazero.planner.moe_cost import overlapped_traffic, paired_share

            experts = work.terms.get("MoE grouped GEMM", 0.0) + work.terms.get("MoE permute",
                                                                                0.0)
            paired = paired_share(pp, cfg.vpp, mb, p.pipeline_schedule,
                                  p.microbatch_group_size_per_vp_stage)
            traffic = overlapped_traffic(traffic, per_mb - experts, experts, paired)
        elif feats.moe_shared_expert_overlap:  # the forward dispatch under the shared expert
            from megazero.planner.moe_cost import shared_expert_overlapped

            traffic = shared_expert_overlapped(traffic, shared_expert_forward_seconds(
                cfg, cluster, feats))
        out.terms["MoE dispatch"] = mb * traffic["dispatch"]
        out.terms["MoE combine"] = mb * traffic["combine"]
        exposed_per_mb += sum(traffic.values())
    if pp > 1:  # the slowest stage sets the pace; (p-1)/(v m) of its time is idle, and the
        # ranks that work meanwhile run ``solo_speedup`` times faster
        idle = (pp - 1) / vpp  # 1F1B, interleaved: in micro-batches of the slowest stage
        if p.pipeline_schedule in ZERO_BUBBLE or p.delay_wgrad_compute:
            # the schedule megazero runs, simulated with F = B = W (a backward split evenly
            # into its input and weight gradients)
            idle = bubble_units(p.pipeline_schedule or "1f1b", pp, mb, p.delay_wgrad_compute)
        out.terms["pipeline bubble"] = ((per_mb + exposed_per_mb) * idle
                                        / cluster.solo_speedup)
        cross = tp * dp >= node and layout.world_size > node
        act = e * s * b * h / (tp if sequence_parallel_active(p.sequence_parallel, tp) else 1)
        bw = cluster.inter_node_gbps if cross else cluster.intra_node_gbps
        sp = sequence_parallel_active(p.sequence_parallel, tp)
        if p2p_scatter_gather and cross and tp > 1 and not sp:
            one = (collective_seconds(cluster, "send_recv", act / tp, 2, bw)
                   + collective_seconds(cluster, "all_gather", act, tp,
                                        cluster.intra_node_gbps))
        else:
            one = collective_seconds(cluster, "send_recv", act, 2, bw)
        out.terms["pipeline p2p"] = 2 * mb * vpp * one
    if rdp > 1:
        out.terms.update(_data_parallel(cfg, cluster, feats, mb, rdp, params_per_rank,
                                        zero3_units, zero3_buckets, compute, per_mb, share))
    offload = z.offload_optimizer.enabled or (z.stage == 3 and z.offload_param.enabled)
    shard = params_per_rank / (rdp if z.stage else 1)
    if offload:
        out.terms["offload PCIe"] = shard * (e + e) / (cluster.pcie_gbps * 1e9)
        out.terms["CPU Adam"] = shard / (cluster.cpu_adam_gparams_per_s * 1e9)
    elif cluster.device_adam_gparams_per_s:
        out.terms["optimizer step"] = shard / (cluster.device_adam_gparams_per_s * 1e9)
    elif cluster.hbm_gbps:  # memory-bound: the bytes the step streams per parameter
        per_param = ADAM_BYTES_16 if sixteen else ADAM_BYTES_32
        out.terms["optimizer step"] = shard * per_param / (cluster.hbm_gbps * 1e9)
    # Megatron's formula (72 B s l h^2 ...) for MFU, so the number compares with papers
    out.model_flops = model_flops_per_iteration(gbs, m.seq_length, m.num_layers, h,
                                                m.vocab_size)
    if m.moe.num_experts is not None:  # MoE: the active parameters' FLOPs, GEMM by GEMM
        from megazero.observability.flops import gpt_flops_per_iteration

        out.model_flops = gpt_flops_per_iteration(m, gbs)
    return out


def shared_expert_forward_seconds(cfg: MegazeroConfig, cluster: Cluster,
                                  features: Features) -> float:
    """The shared experts' forward GEMMs of one micro-batch over the slowest stage's MoE layers
    (what ``--moe-shared-expert-overlap`` hides the forward dispatch under)."""
    from megazero.planner.moe_cost import moe_layers

    m, p = cfg.model, cfg.parallel
    shared = m.moe.moe_shared_expert_intermediate_size or 0
    tokens = cfg.train.micro_batch_size * m.seq_length / p.cp
    flops = tokens * 2 * m.hidden_size * shared * ((2 if m.swiglu else 1) + 1) / p.tp
    sixteen = cfg.precision.params_dtype.itemsize == 2
    rate = cluster.gemm_rate(sixteen, bool(features.fp8))
    return moe_layers(cfg) / p.pp * flops / rate


def _data_parallel(cfg: MegazeroConfig, cluster: Cluster, feats: Features, mb: int, dp: int,
                   params_per_rank: int, zero3_units: int, zero3_buckets: int,
                   compute: float, per_mb: float, share: float) -> dict[str, float]:
    """The data-parallel (and ZeRO) terms over the ``dp`` ranks that hold the same weights."""
    z, tp = cfg.zero, cfg.parallel.tp
    e = cfg.precision.params_dtype.itemsize
    passes = 3.0 + share
    bw = dp_link_gbps(cluster, tp, dp)
    buf = e * params_per_rank
    gathered = (1 if feats.fp8_param_gather else e) * params_per_rank  # FP8 gathers: a byte
    out = {}
    if z.stage == 3:
        # parameters gathered for every micro-batch's forward and backward, gradients
        # reduce-scattered after every micro-batch's backward (partitioned across the
        # accumulation, as DeepSpeed's): ``3mΨ(N-1)/N`` bytes; two gathers per unit and
        # one reduce-scatter per bucket per micro-batch (units small enough to be
        # latency-bound)
        ag, rs = (alpha_beta(cluster, k, bw) for k in ("all_gather", "reduce_scatter"))
        comm = mb * (2 * wire_bytes("all_gather", gathered, dp) / ag[1]
                     + wire_bytes("reduce_scatter", buf, dp) / rs[1])
        out["ZeRO-3 gather latency"] = mb * (zero3_units * 2 * ag[0] + zero3_buckets * rs[0])
        if z.overlap_comm and cluster.comm_overlaps_compute:
            comm = max(0.0, comm - compute * 2 / 3)
    else:
        calls = max(1, -(-params_per_rank // max(1, z.reduce_bucket_size)))
        reduce = calls * collective_seconds(
            cluster, "all_reduce" if z.stage == 0 else "reduce_scatter", buf / calls, dp, bw)
        # stage 2 reduces every micro-batch's gradients (partitioned across accumulation)
        reductions = mb if z.stage == 2 else 1
        reduce *= reductions
        gather = 0.0 if z.stage == 0 else calls * collective_seconds(
            cluster, "all_gather", gathered / calls, dp, bw)
        if cluster.comm_overlaps_compute:
            # stages 0-1 accumulate under no_sync, so only the last micro-batch's backward
            # (and its recomputed forward) hides their reduction, stage 2's each
            # micro-batch's own; the parameters' all-gather after the step hides behind
            # the first forward of the next one
            if z.overlap_comm:
                reduce = max(0.0, reduce - reductions * per_mb * (passes - 1) / passes)
            if z.overlap_param_gather:
                gather = max(0.0, gather - per_mb / passes)
        comm = reduce + gather
    out["data parallel"] = comm
    return out
