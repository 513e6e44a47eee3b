"""Device-memory traffic of a layer's non-GEMM kernels, for clusters that state their HBM bandwidth.

On a GPU the GEMMs run near the tensor cores' peak while the norms, bias + dropout + residual
adds, activation functions, the layout copies around attention and the attention softmax are
bound by memory bandwidth: their time is the bytes they move over ``hbm_gbps``, not a share of
the GEMM time. Per token of a layer's forward on one TP rank, with 16-bit elements of ``e``
bytes and 1-byte dropout masks (fused kernels: each reads its inputs and writes its outputs
once)::

    replicated over TP ranks unless SP splits them:
        2 norms                     read + write h          -> 2 x 2eh
        2 bias-dropout-residual     read x and residual,     -> 2 x (3eh + h)
                                    write out (+ mask)
    split over TP ranks:
        MLP activation              read + write f (SwiGLU: read 2f, write f)
        attention layout copies     Q, K, V in (h + 2 g d) and the context h, read + write
        softmax (unless flash)      read + write s per head          -> 2es a
        attention dropout           read + write s, write the mask   -> (2e + 1)s a

The backward moves about twice the forward's bytes (each kernel reads the saved input and the
output gradient and writes the input gradient; the norm and softmax backward read one tensor
more); full recompute adds one forward, selective recompute the softmax and dropout forward.
With flash attention the ``s x s`` scores never reach memory: that traffic is zero and the
kernel's time is its FLOPs (counted with the GEMMs). The loss's vocabulary-wide elementwise work
on the last stage is left out: about 20 bytes per vocabulary entry and token on its TP rank,
around 1% of a step for Table 1's shapes.
"""

from __future__ import annotations

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active
from megazero.planner.activations import recomputed_share

BACKWARD_OVER_FORWARD = 2.0


def layer_forward_bytes(cfg: MegazeroConfig, flash: bool) -> tuple[float, float]:
    """(all non-GEMM bytes, the core attention's share) of one layer's forward for one token on
    one TP rank. An MoE layer's MLP activation is its shared expert's (if any); its routed
    rows' traffic is :func:`megazero.planner.moe_compute.routed_row_bytes` (MoE layers are
    weighted by their share of the layers)."""
    m, p = cfg.model, cfg.parallel
    e = cfg.precision.params_dtype.itemsize
    tp = p.tp
    h, s, f = m.hidden_size, m.seq_length, m.ffn_size
    kv = m.query_groups * m.head_dim
    hidden_mask = 1 if m.hidden_dropout > 0 else 0
    replicated = 2 * 2 * e * h + 2 * (3 * e * h + hidden_mask * h)
    if sequence_parallel_active(p.sequence_parallel, tp):
        replicated /= tp
    moe = 0.0
    if m.moe.num_experts is not None:
        moe = sum(m.moe.is_moe_layer(i, m.num_layers) for i in range(m.num_layers)) / m.num_layers
    shared = m.moe.moe_shared_expert_intermediate_size or 0
    act = (3 if m.swiglu else 2) * e * ((1 - moe) * f + moe * shared)
    q = m.num_attention_heads * m.head_dim  # h unless --kv-channels
    copies = 2 * e * (q + 2 * kv) + 2 * e * q
    core = 0.0
    if not flash:
        attn_mask = 1 if m.attention_dropout > 0 else 0
        core = (2 * e + attn_mask * (2 * e + 1)) * s * m.num_attention_heads / tp
    return replicated + (act + copies) / tp + core, core


def stage_nongemm_bytes(cfg: MegazeroConfig, flash: bool, layers: float | None = None) -> float:
    """Non-GEMM HBM bytes of one micro-batch on one stage of ``layers`` layers (default
    ``layers / pp``), forward + backward and the recomputed forward: what the slowest stage
    moves per micro-batch."""
    m, p = cfg.model, cfg.parallel
    fwd, core = layer_forward_bytes(cfg, flash)
    passes = 1.0 + BACKWARD_OVER_FORWARD
    per_token = passes * fwd
    if p.recompute.granularity == "full":
        per_token += recomputed_share(cfg) * fwd
    elif p.recompute.granularity == "selective":
        per_token += core
    tokens = cfg.train.micro_batch_size * m.seq_length / p.cp  # the rank's share with CP
    return tokens * per_token * (m.num_layers / p.pp if layers is None else layers)
