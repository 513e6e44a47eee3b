"""One micro-batch's compute on the slowest pipeline stage, by kind of work.

Per token of a layer on one TP rank, forward FLOPs:

* linear layers (QKV with grouped-query K/V, the projection, a dense MLP with two or three
  matrices, a shared expert): at the FP8 rate where :attr:`Features.fp8` says they run FP8,
  else at the 16-bit rate (``peak x achievable_fraction``);
* core attention, scores and values ``2 x 2 s q``: 16-bit. Kernels that skip the blocks a
  causal mask removes (``Cluster.flash_skips_masked``, with flash attention) compute half the
  square, or the window of a sliding-window layer, and their backward recomputes the scores
  (2.5x the forward's FLOPs, 3.5 passes in all); otherwise the whole square, 3 passes;
* the router and the logits (on the last stage): 16-bit;
* the routed experts: a grouped GEMM (:mod:`megazero.planner.moe_compute`).

GEMMs run 3 passes (forward, two in backward), plus a forward for the recomputed share of the
layers (:func:`megazero.planner.activations.recomputed_share`, core attention included);
selective recompute reruns the core attention's forward only.
The non-GEMM kernels cost their device-memory bytes on a cluster that gives ``hbm_gbps``
(:mod:`megazero.planner.hbm_traffic`; the FP8 casts and the routed rows' traffic are terms of
their own), else ``nongemm_share`` of the GEMM time. The cluster's per-layer and per-micro-
batch overheads are added per pass over a layer and per chunk.

The slowest stage holds ``layers / pp`` layers and the logits (the last stage); with Megatron's
embedding and loss slots (:attr:`Features.embedding_and_loss_slots`) a middle stage holds
``slots / pp`` layers and the last one a layer less plus the logits, whichever is slower (one
stage alone: two slots less).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.planner.activations import recomputed_share
from megazero.planner.cluster import Cluster
from megazero.planner.features import Features


@dataclass
class LayerWork:
    """Forward FLOPs per token of an average layer of the model (MoE layers weighted by their
    share), before the TP split."""

    linear: float  # QKV, projection, dense MLP, shared expert
    attention: float  # core attention (the part the kernel computes)
    router: float
    moe_share: float  # MoE layers / layers


def layer_work(cfg: MegazeroConfig, cluster: Cluster, features: Features,
               flash: bool) -> LayerWork:
    m = cfg.model
    h, s = m.hidden_size, m.seq_length
    kv, q = m.query_groups * m.head_dim, m.num_attention_heads * m.head_dim
    glu = 2 if m.swiglu else 1
    from megazero.planner.moe_cost import moe_layers

    moe = moe_layers(cfg) / cfg.model.num_layers if m.moe.num_experts is not None else 0.0
    linear = 2 * h * (q + 2 * kv) + 2 * q * h + (1 - moe) * 2 * h * m.ffn_size * (glu + 1)
    router = 0.0
    if moe:
        shared = m.moe.moe_shared_expert_intermediate_size or 0
        linear += moe * (2 * h * shared * (glu + 1) + (2 * h if m.moe.moe_shared_expert_gate
                                                       else 0))
        router = moe * 2 * h * m.moe.num_experts
    keys = float(s)
    if flash and cluster.flash_skips_masked:  # causal: half the square; windows: the window
        window = features.sliding_window or s
        w = features.sliding_window_share
        keys = (1 - w) * s / 2 + w * min(window, s / 2)
    return LayerWork(linear, 2 * 2 * keys * q, router, moe)


@dataclass
class MicrobatchCompute:
    """Seconds of one micro-batch on the slowest stage, by term, and what overlap can hide
    behind: ``linear_per_layer`` (a layer's linear GEMMs, where TP communication runs with
    ``tp_comm_overlap``)."""

    terms: dict[str, float] = field(default_factory=dict)
    layers: float = 0.0
    linear_per_layer: float = 0.0
    attention: float = 0.0  # the stage's core attention (what ring CP hides its K/V behind)

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())


def _stage(cfg: MegazeroConfig, cluster: Cluster, features: Features, flash: bool,
           layers: float, logits: bool) -> MicrobatchCompute:
    from megazero.planner.hbm_traffic import stage_nongemm_bytes

    m, p = cfg.model, cfg.parallel
    e = cfg.precision.params_dtype.itemsize
    sixteen = e == 2
    tp = p.tp
    tokens = cfg.train.micro_batch_size * m.seq_length / p.cp
    work = layer_work(cfg, cluster, features, flash)
    share = recomputed_share(cfg)
    passes = 3.0 + share
    skip = flash and cluster.flash_skips_masked
    # the recomputed layers rerun their core attention too; selective recompute only that
    rerun = share or (1.0 if p.recompute.granularity == "selective" else 0.0)
    attn_passes = (3.5 if skip else 3.0) + rerun
    rate16 = cluster.gemm_rate(sixteen)
    rate_lin = cluster.gemm_rate(sixteen, bool(features.fp8))
    fp8_share = features.fp8_layer_share if features.fp8 else 0.0
    # the layers --first-last-layers-bf16 keeps run their linears at the 16-bit rate
    linear = tokens * work.linear * passes / tp * (
        fp8_share / rate_lin + (1 - fp8_share) / rate16 if features.fp8 else 1 / rate_lin)
    other = tokens * (work.router * passes + work.attention * attn_passes) / tp / rate16
    out = MicrobatchCompute(layers=layers, linear_per_layer=linear)
    out.attention = layers * tokens * work.attention * attn_passes / tp / rate16
    gemm = layers * (linear + other)
    if logits:
        gemm += tokens * 3.0 * 2 * m.hidden_size * m.vocab_size / tp / rate16
    experts = 0.0
    if work.moe_share:
        from megazero.planner.moe_compute import grouped_gemm_seconds

        experts = layers * work.moe_share * grouped_gemm_seconds(cfg, cluster, features,
                                                                 passes)
    compute = gemm
    if cluster.hbm_gbps:  # the non-GEMM kernels cost the bytes they move
        hbm = cluster.hbm_gbps * 1e9
        compute += stage_nongemm_bytes(cfg, flash, layers) / hbm
        if features.fp8:
            from megazero.planner.fp8_cost import dense_cast_bytes

            recipe = features.fp8
            casts = (work.moe_share * dense_cast_bytes(cfg, True, recipe)
                     + (1 - work.moe_share) * dense_cast_bytes(cfg, False, recipe))
            out.terms["FP8 casts"] = tokens * layers * fp8_share * casts / hbm
        if work.moe_share:
            from megazero.planner.moe_compute import routed_row_bytes

            out.terms["MoE permute"] = (layers * work.moe_share
                                        * routed_row_bytes(cfg, features, 1.0 + share) / hbm)
    else:
        sp = sequence_parallel_active(p.sequence_parallel, tp)
        compute += (gemm + experts) * tp * cluster.nongemm_share / (tp if sp else 1)
    compute += cluster.per_layer_overhead_us * 1e-6 * passes * layers
    compute += cluster.per_microbatch_overhead_us * 1e-6 * (cfg.vpp or 1)
    out.terms = {"compute": compute, **out.terms}
    if experts:
        out.terms["MoE grouped GEMM"] = experts
    return out


def microbatch_compute(cfg: MegazeroConfig, cluster: Cluster, features: Features,
                       flash: bool) -> MicrobatchCompute:
    """The slowest stage's compute for one micro-batch."""
    pp = cfg.parallel.pp
    if features.embedding_and_loss_slots:  # the first stage's first slot is the embedding,
        slots = cfg.model.num_layers / pp   # the last one's last the loss
        candidates = [(slots - (2.0 if pp == 1 else 1.0), True)]
        if pp > 2:  # a middle stage: all its slots are layers
            candidates.append((slots, False))
    else:
        candidates = [(cfg.model.num_layers / pp, True)]
    return max((_stage(cfg, cluster, features, flash, n, lg) for n, lg in candidates),
               key=lambda c: c.seconds)
