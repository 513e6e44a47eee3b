"""Activation bytes per rank: per-layer saved bytes times what the pipeline schedule keeps alive.

Per layer, Megatron's accounting (Korthikanti et al. 2022; DESIGN.md section 3), generalised to
grouped-query attention and any FFN width, 16-bit activations with 1-byte dropout masks (4-byte
in fp32 runs: every 2 below becomes the element size)::

    replicated over TP ranks unless SP:  LN inputs 2sbh x 2, QKV and MLP inputs 2sbh x 2,
                                         two dropout masks sbh x 2               -> 10 sbh
    split over TP ranks:  Q 2sbh, K and V 2sb(g d) each, projection input 2sbh,
                          MLP: fc1 output and activation output 2 sb f each (SwiGLU: 4 x 2sbf,
                          gate and up halves, silu(gate), the product), RoPE: the unrotated
                          Q and K and their rotate-half copies (2sbh + 2sb(g d) twice),
                          core attention 5 a s^2 b
                          (scores 2, dropout mask 1, dropout output 2; dropped by selective
                          recompute, and by flash attention, which saves only a log-sum-exp)

For gpt2 (g = a, f = 4h) this is ``sbh(10 + 24/t + 5as/(ht))`` exactly, and the measured saved
bytes of the unfused attention backend agree within 0.2% (bench/activation_memory.py).
Besides Megatron's terms, :func:`layer_stat_bytes` counts what the formula leaves out: each
norm's fp32 per-token statistics (LayerNorm mean and 1/std, RMSNorm 1/rms) and, when the core
attention saves no ``s^2`` term (flash attention, or SDPA's fused kernels), its fp32
log-sum-exp per head and token. Not modelled: RMSNorm through torch's composite ``F.rms_norm``
(CPU) saves fp32 intermediates, about 5h bytes per token per norm more than the ``2sbh`` input
counted here; fused kernels (CUDA) save the input and one fp32 value per token, as counted.
Full recompute keeps only each recomputed segment's input (``2sbh``, divided by t with SP) and
rematerialises one segment at a time in backward.

How many micro-batches a rank holds comes from the schedule itself
(:func:`megazero.pipeline.schedules.build_schedule`): the peak count of forwards whose backward
has not run, per chunk. For 1F1B the first stage holds ``min(pp, m)``; interleaved holds
``2(p-1) + (v-1)N + 1`` chunk-forwards (N the micro-batch group size, default p: ``pv + p - 1``,
i.e. ``p (1 + (p-1)/(pv))`` micro-batches of its layers), at most all ``v m`` of them.
"""

from __future__ import annotations

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active


def local_seq(cfg: MegazeroConfig) -> int:
    """Positions of each sequence one rank's activations cover: with context parallelism the
    rank's share, ``seq / cp`` (every activation term scales with it)."""
    return cfg.model.seq_length // cfg.parallel.cp


def recomputed_share(cfg: MegazeroConfig) -> float:
    """Share of the layers whose forward runs again in backward: all of them with full
    recompute by ``uniform`` groups, the first ``--recompute-num-layers`` of each chunk by
    ``block``; none otherwise (selective recompute reruns only the core attention)."""
    rc, p = cfg.parallel.recompute, cfg.parallel
    if rc.granularity != "full":
        return 0.0
    if rc.method == "block":
        per_chunk = cfg.model.num_layers / (p.pp * (cfg.vpp or 1))
        return min(rc.num_layers, per_chunk) / per_chunk
    return 1.0


def cp_blockwise(cfg: MegazeroConfig) -> bool:
    """Context-parallel ring or all-gather attention: blockwise, it keeps the output and an fp32
    log-sum-exp per head and token, never an ``s^2`` term (as flash attention)."""
    return cfg.parallel.cp > 1 and cfg.parallel.cp_comm_type != "a2a"


def layer_bytes(cfg: MegazeroConfig, b: int, tp: int, *, selective: bool = False,
                flash: bool = False) -> float:
    """Saved bytes of one transformer layer for one micro-batch of ``b`` sequences."""
    m, p = cfg.model, cfg.parallel
    e = 4 if cfg.precision.params_dtype.itemsize == 4 else 2
    s, h, a = local_seq(cfg), m.hidden_size, m.num_attention_heads
    kv = m.query_groups * m.head_dim
    qw = a * m.head_dim  # the queries' (and context's) width: h unless --kv-channels
    flash = flash or cp_blockwise(cfg)
    f = m.ffn_size
    sp = sequence_parallel_active(p.sequence_parallel, tp)
    mask = 1 if (m.hidden_dropout > 0) else 0
    replicated = s * b * (4 * e * h + 2 * mask * h)
    if sp:
        replicated /= tp
    mlp = (4 if m.swiglu else 2) * e * s * b * f
    rope = 2 * e * s * b * (qw + kv) if m.position_embedding_type == "rope" else 0
    qk_norm = e * s * b * (qw + kv) if m.qk_layernorm else 0  # the q/k norms' inputs
    attn_mask = 1 if m.attention_dropout > 0 else 0
    # (a2a: a/cp heads over the whole sequence, i.e. a * s_local * seq scores)
    core = 0.0 if (selective or flash) else \
        (e + attn_mask + e * attn_mask) * a * s * m.seq_length * b
    # a2a (Ulysses) keeps one more context-sized tensor: the head-split output it permutes
    # back into the zigzag order before the second all-to-all
    ulysses = e * s * b * qw if (p.cp > 1 and p.cp_comm_type == "a2a") else 0
    if m.multi_latent_attention:
        return replicated + mla_attention_bytes(cfg, b, tp) + (mlp + core + ulysses) / tp
    split = (e * s * b * (2 * qw + 2 * kv) + mlp + rope + qk_norm + core + ulysses) / tp
    return replicated + split


def mla_attention_bytes(cfg: MegazeroConfig, b: int, tp: int) -> float:
    """Multi-latent attention's saved bytes besides the core's scores, per micro-batch: on
    every TP rank the whole (gathered) input of the down-projections and the latents (the
    norms' inputs and outputs, the shared key's rotation); split over TP ranks the heads'
    queries, keys and values (zero-padded to one width for the core), the rotated parts'
    inputs and the output projection's input."""
    m = cfg.model
    e = 4 if cfg.precision.params_dtype.itemsize == 4 else 2
    s, h, a = local_seq(cfg), m.hidden_size, m.num_attention_heads
    pe, v = m.qk_pos_emb_head_dim, m.v_head_dim
    width = max(m.qk_head_dim + pe, v)
    latent = e * s * b * (h + 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + 2 * pe)
    heads = e * s * b * a * (3 * width + v + 2 * pe)
    return latent + heads / tp


def layer_stat_bytes(cfg: MegazeroConfig, b: int, tp: int, *, flash: bool = False,
                     sdpa_math: bool = False) -> float:
    """fp32 per-token values one layer saves besides its activations: two norms' statistics
    (2 each for LayerNorm, 1 for RMSNorm; split over TP ranks with SP), the q/k norms' per
    query and key head (``--qk-layernorm``, split over TP ranks) and the attention
    log-sum-exp (one per head and token, split over TP ranks) when ``flash``.

    ``sdpa_math``: the core attention is SDPA's math path (CPU with attention dropout), which
    computes in fp32 whatever the element size ``e``: scores, dropout mask and dropout output
    at 4 bytes each (``12 a s^2 b`` instead of ``(2e + 1) a s^2 b``), a scaled copy of Q at 4
    bytes and Q in fp32 (``(4 + 4 - e) s b h`` more); all split over TP ranks. Measured on
    gpt2-style layers within 3% (fp32) and 2% (bf16) per layer."""
    m = cfg.model
    s = local_seq(cfg)
    sp = sequence_parallel_active(cfg.parallel.sequence_parallel, tp)
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    out = 2 * per_norm * 4 * s * b / (tp if sp else 1)
    if m.qk_layernorm:
        out += per_norm * 4 * s * b * (m.num_attention_heads + m.query_groups) / tp
    if flash or cp_blockwise(cfg):
        out += 4 * s * b * m.num_attention_heads / tp
    elif sdpa_math:
        e = 4 if cfg.precision.params_dtype.itemsize == 4 else 2
        out += ((11 - 2 * e) * m.num_attention_heads * s * s * b
                + (8 - e) * s * b * m.hidden_size) / tp
    return out


def inflight_chunk_forwards(pp: int, vpp: int | None, num_microbatches: int,
                            pp_rank: int, group_size: int | None = None) -> int:
    """Peak number of (chunk, micro-batch) forwards whose backward has not run, from the
    schedule this rank executes."""
    from megazero.pipeline.schedules import build_schedule

    live = peak = 0
    for step in build_schedule(pp, vpp, num_microbatches, pp_rank, group_size=group_size):
        for act in step:
            if act.kind == "F":
                live += 1
                peak = max(peak, live)
            elif act.kind == "B":
                live -= 1
    return peak


def recompute_layer_bytes(cfg: MegazeroConfig, b: int, tp: int, layers: int, *,
                          flash: bool = False, sdpa_math: bool = False) -> float:
    """Saved bytes of ``layers`` layers of one chunk for one micro-batch, by recompute mode,
    plus the transient peak of rematerialising one full-recompute segment in backward."""
    p, rc = cfg.parallel, cfg.parallel.recompute
    stats = layer_stat_bytes(cfg, b, tp, flash=flash, sdpa_math=sdpa_math)
    full = layer_bytes(cfg, b, tp, flash=flash) + stats
    if rc.granularity == "selective":  # the recomputed core attention saves no lse
        return layers * (layer_bytes(cfg, b, tp, selective=True, flash=flash)
                         + layer_stat_bytes(cfg, b, tp))
    if rc.granularity != "full":
        return layers * full
    e = 4 if cfg.precision.params_dtype.itemsize == 4 else 2
    sp = sequence_parallel_active(p.sequence_parallel, tp)
    # a group's kept input: split over TP by SP or by --distribute-saved-activations, and off
    # the device with cpu_checkpointing (megazero/tensor_parallel/saved_inputs.py)
    split = sp or (rc.distribute_saved_activations and tp > 1)
    boundary = 0.0 if rc.cpu_checkpointing else (
        e * local_seq(cfg) * b * cfg.model.hidden_size / (tp if split else 1))
    k = rc.num_layers
    if rc.method == "uniform":
        segments = -(-layers // k)
        return segments * boundary
    kept = max(0, layers - k)  # block: the first k layers recompute, the rest keep everything
    return min(k, layers) * boundary + kept * full


def segment_peak_bytes(cfg: MegazeroConfig, b: int, tp: int, layers: int,
                       flash: bool = False, sdpa_math: bool = False) -> float:
    """Extra bytes while backward rematerialises one full-recompute segment."""
    rc = cfg.parallel.recompute
    if rc.granularity != "full":
        return 0.0
    k = min(rc.num_layers, layers)
    return k * (layer_bytes(cfg, b, tp, flash=flash)
                + layer_stat_bytes(cfg, b, tp, flash=flash, sdpa_math=sdpa_math))


def local_logits(cfg: MegazeroConfig, b: int, tp: int) -> int:
    """Elements of one micro-batch's vocab-parallel logits on one TP rank: ``s b V/t``, ``V``
    padded as the model pads it."""
    m = cfg.model
    vocab = -(-m.vocab_size // (m.make_vocab_size_divisible_by * tp)) * \
        m.make_vocab_size_divisible_by * tp
    return local_seq(cfg) * b * vocab // tp


def embedding_logits_bytes(cfg: MegazeroConfig, b: int, tp: int, first: bool, last: bool
                           ) -> float:
    """Embedding output (dropout mask) on the first stage; final norm input and the loss's
    one fp32 buffer of the vocab-parallel logits (the softmax it keeps for backward: the fp32
    logits themselves, worked in place, or the fp32 cast of 16-bit ones) on the last stage."""
    m = cfg.model
    e = 4 if cfg.precision.params_dtype.itemsize == 4 else 2
    s, h = local_seq(cfg), m.hidden_size
    sp = sequence_parallel_active(cfg.parallel.sequence_parallel, tp)
    out = 0.0
    if first and m.hidden_dropout > 0:
        out += s * b * h / (tp if sp else 1)
    if last:
        per_norm = 2 if m.normalization == "LayerNorm" else 1
        out += (e * s * b * h + per_norm * 4 * s * b) / (tp if sp else 1) + e * s * b * h \
            + 4 * local_logits(cfg, b, tp)
    return out


def loss_transient_bytes(cfg: MegazeroConfig, b: int, tp: int) -> float:
    """Bytes beside the saved fp32 buffer while the last stage's loss runs: with 16-bit
    logits, the logits themselves during forward (cast into the buffer) and their 16-bit
    gradient during backward (cast out of it); with fp32 logits none (the loss works in the
    logits' own storage; megazero.tensor_parallel.cross_entropy)."""
    e = cfg.precision.params_dtype.itemsize
    return 0.0 if e == 4 else float(e * local_logits(cfg, b, tp))


def chunk_saved_bytes(cfg: MegazeroConfig, pp_rank: int, *, flash: bool,
                      sdpa_math: bool = False) -> list[float]:
    """Saved bytes of one micro-batch's forward through each model chunk of this rank."""
    from megazero.config.schema import layer_counts
    from megazero.pipeline.schedules import virtual_stage
    from megazero.pipeline.zero_bubble import placement_of

    p = cfg.parallel
    tp, pp, vpp = p.tp, p.pp, cfg.vpp or 1
    b = cfg.train.micro_batch_size
    placement = placement_of(p.pipeline_schedule)
    counts = layer_counts(cfg) or [cfg.model.num_layers // (pp * vpp)] * (pp * vpp)
    out = []
    for c in range(vpp):
        v = virtual_stage(pp_rank, c, pp, placement)  # its own layers, embedding and loss
        out.append(recompute_layer_bytes(cfg, b, tp, counts[v], flash=flash,
                                         sdpa_math=sdpa_math)
                   + embedding_logits_bytes(cfg, b, tp, v == 0, v == pp * vpp - 1))
    return out


def peak_saved_bytes(cfg: MegazeroConfig, pp_rank: int, num_microbatches: int, *,
                     flash: bool, sdpa_math: bool = False) -> float:
    """Peak bytes autograd holds for backward on pipeline rank ``pp_rank``: walk the step list
    :func:`megazero.pipeline.zero_bubble.schedule_steps` gives this rank (the one the executor
    runs, any ``--pipeline-schedule``, in combined 1F1B order under
    ``--overlap-moe-expert-parallel-comm``: a forward runs before the backward it pairs with,
    one micro-batch more held); each forward adds its chunk's saved bytes until its
    backward, or its W when the schedule splits backwards. This is what the
    executor's activation meter measures (``ActivationMeter.peak_saved_bytes``); the transient of
    rematerialising a full-recompute segment in backward comes on top
    (:func:`segment_peak_bytes`)."""
    from megazero.pipeline.zero_bubble import schedule_steps

    p = cfg.parallel
    pp = p.pp
    chunk_bytes = chunk_saved_bytes(cfg, pp_rank, flash=flash, sdpa_math=sdpa_math)
    live = peak = 0.0
    steps = schedule_steps(pp, cfg.vpp, num_microbatches, pp_rank,
                           group_size=p.microbatch_group_size_per_vp_stage,
                           schedule=p.pipeline_schedule, delay_wgrad=p.delay_wgrad_compute,
                           combined=p.overlap_moe_expert_parallel_comm)
    split = any(st[0].kind == "W" for st in steps)
    for step in steps:
        for a in step:
            if a.kind == "F":
                live += chunk_bytes[a.chunk]
                peak = max(peak, live)
            elif a.kind == ("W" if split else "B"):
                # a split backward's W stash (inputs and output grads of the GEMMs) is
                # charged as the whole forward's activations until its W: an upper bound
                live -= chunk_bytes[a.chunk]
    return peak


def uses_sdpa_math(cfg: MegazeroConfig, device_is_cpu: bool) -> bool:
    """CPU SDPA with attention dropout runs the math path (see :func:`layer_stat_bytes`)."""
    return core_attention_saves_scores(cfg, device_is_cpu)


def core_attention_saves_scores(cfg: MegazeroConfig, device_is_cpu: bool) -> bool:
    """Whether the core attention saves the ``5as^2b`` term. CUDA: never (flash-attn, or SDPA's
    flash / memory-efficient kernels, which save a log-sum-exp). CPU: SDPA runs a fused kernel
    without attention dropout and the math path (scores, mask, dropout output) with it."""
    return device_is_cpu and cfg.model.attention_dropout > 0
