"""What FP8 GEMMs cost besides their FLOPs: the casts of their inputs, in device-memory bytes.

With per-tensor current scaling (Transformer Engine's ``Float8CurrentScaling``, Megatron's
``--fp8-recipe tensorwise``) every FP8 GEMM input is scaled by its own amax, known only once the
whole tensor exists, so each cast is two passes over the 16-bit tensor: one reading it for the
amax, one reading it again and writing one byte per element in row-major order and one in
column-major order (Hopper's FP8 GEMMs take only the "TN" layout, so the weight-gradient GEMM
needs the transposed copy, which the cast writes in the same pass)::

    bytes per element cast = e (amax) + e (read) + 1 + 1 (row- and column-wise)

Per token of a layer, forward: the input of every FP8 linear layer (QKV and fc1 take the
normalised hidden state ``h``, the projection the context ``q``, fc2 the activation ``f``);
backward: the output gradient of every one of them (QKV ``q + 2 g d``, projection ``h``, fc1
``f`` or ``2f`` with a gated unit, fc2 ``h``). The experts cast their routed rows the same
way (:mod:`megazero.planner.moe_compute`). With sequence parallelism the inputs of QKV and fc1
and the output gradients of the projection and fc2 are cast on the rank's ``1/tp`` share before
their all-gather (which then moves FP8); without it every TP rank casts the whole ``h``.

Delayed scaling knows the scale before the tensor is made, and blockwise scaling finds each
1 x 128 tile's amax in the pass that casts it: one pass, ``e + 2`` bytes per element
(:func:`cast_bytes_per_element` with the recipe).

Not counted: the weights' casts (once per step, not per micro-batch: Transformer Engine keeps
the FP8 weights across the micro-batches of a step), the amax all-reduce over the TP group (a
few bytes), and the FP8 input all-gather's halved bytes (the TP term keeps 16-bit bytes).
"""

from __future__ import annotations

from megazero.config import MegazeroConfig
from megazero.config.rules import sequence_parallel_active


def cast_bytes_per_element(elem: int, recipe: str = "tensorwise") -> float:
    """Device-memory bytes one cast moves per element of a ``elem``-byte tensor: under current
    (tensorwise) scaling an amax pass, and a pass writing row- and column-wise FP8 copies;
    the latter alone under delayed or blockwise scaling."""
    return (2.0 if recipe == "tensorwise" else 1.0) * elem + 2.0


def dense_cast_bytes(cfg: MegazeroConfig, moe_layer: bool, recipe: str = "tensorwise"
                     ) -> float:
    """Cast bytes per token of one layer on one TP rank, forward and backward together: the
    attention's linear layers and, unless ``moe_layer``, the dense MLP's (the experts' casts
    are per routed row, in :mod:`megazero.planner.moe_compute`; a shared expert's are here)."""
    m, p = cfg.model, cfg.parallel
    tp = p.tp
    split = tp if sequence_parallel_active(p.sequence_parallel, tp) else 1
    h, kv, q = m.hidden_size, m.query_groups * m.head_dim, m.num_attention_heads * m.head_dim
    glu = 2 if m.swiglu else 1
    # forward inputs: QKV (h, gathered), projection (q / tp, local); backward output
    # gradients: QKV (q + 2kv) / tp, projection (h, gathered)
    elems = h / split + q / tp + (q + 2 * kv) / tp + h / split
    ffn = 0
    if not moe_layer:
        ffn = m.ffn_size
    elif m.moe.moe_shared_expert_intermediate_size:
        ffn = m.moe.moe_shared_expert_intermediate_size
    if ffn:  # fc1 input h (gathered), fc2 input f / tp; gradients: fc1 out glu f / tp, fc2 h
        elems += h / split + ffn / tp + glu * ffn / tp + h / split
    return elems * cast_bytes_per_element(cfg.precision.params_dtype.itemsize, recipe)


def cast_buffer_bytes(cfg: MegazeroConfig) -> float:
    """Device bytes the FP8 copies of one GEMM's operands hold while it runs, at the largest
    GEMM of a layer: its input (gathered under SP) and its weight, each cast once row-wise and
    once column-wise (the weight-gradient GEMM's transposed copy), one byte per element.
    Transient: megazero.fp8 saves the 16-bit tensors for backward and casts again there."""
    m, p = cfg.model, cfg.parallel
    tp = p.tp
    tokens = cfg.train.micro_batch_size * m.seq_length / p.cp
    h, kv, q = m.hidden_size, m.query_groups * m.head_dim, m.num_attention_heads * m.head_dim
    ffn = m.moe.moe_ffn_hidden_size if m.moe.enabled and m.moe.moe_ffn_hidden_size else \
        m.ffn_size
    glu = 2 if m.swiglu else 1
    inputs = tokens * max(h, q / tp, ffn / tp)
    weights = max(h * (q + 2 * kv), h * glu * ffn, h * q) / tp
    return 2.0 * (inputs + weights)
