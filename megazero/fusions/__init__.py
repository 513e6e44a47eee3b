"""Megatron's fused elementwise operations, built with ``torch.compile``.

megatron-core fuses the elementwise work around its GEMMs (``megatron/core/fusions``): the bias
add with the GELU or SwiGLU that follows it, the bias add with the residual dropout-add, and the
rotary embedding of queries and keys. Done eagerly each is several kernels that read and write
the whole activation; on a GPU these passes cost about a fifth of a step. Here every operation
is a small pure function with an eager reference, and its fused form is the same function
compiled by :func:`megazero.fusions.compiled.fuse` (inductor generates one kernel for forward
and one for backward), so the two can be compared in tests.

Fused only where it pays: on CUDA, when the model's switch is on (``--no-bias-gelu-fusion``
and friends turn them off, Megatron's defaults are on); on CPU only when asked
(``--fusions-on-cpu``, for tests). See :func:`megazero.fusions.compiled.use_fusion`.

Dropout: a compiled region draws its random numbers its own way, not like the eager
``native_dropout``, so the same seed would give another mask and the fused run would not train
the same model as the unfused one. The bias-dropout-add is therefore fused only when no mask is
drawn (hidden dropout 0, or evaluation); with dropout > 0 in training the mask is drawn eagerly
from the RNG tracker's stream exactly as before, and the bias and residual adds run eagerly
around it (:mod:`megazero.fusions.fused_bias_dropout`).
"""

from megazero.fusions.compiled import compiler_available, fuse, use_fusion
from megazero.fusions.fused_bias_dropout import bias_add_residual
from megazero.fusions.fused_bias_gelu import bias_gelu
from megazero.fusions.fused_bias_swiglu import bias_swiglu
from megazero.fusions.fused_rope import rope_qk

__all__ = ["bias_add_residual", "bias_gelu", "bias_swiglu", "compiler_available", "fuse",
           "rope_qk", "use_fusion"]
