"""Bytes the 1-bit optimizers keep per master piece beyond Adam's moments.

:func:`megazero.zero.optimizers.state_layout` counts the tensors shaped like the parameter
(``exp_avg``, ``exp_avg_sq``, and OneBitLamb's ``exp_avg_sq_fresh``) and the ``step`` scalar.
The 1-bit family keeps more, per optimizer parameter (a master piece, cut at
``sub_group_size``), and its shapes follow the data-parallel size ``d`` of the compressed
all-reduce (:func:`megazero.optim.compressed.error_buffers`): a piece of ``n`` elements has a
worker error of ``padded_numel(n, d)`` fp32 (n rounded up to a multiple of 8 d) and a server
error of ``padded_numel(n, d) / d`` fp32. What each optimizer holds once it has stepped in its
compressed phase (the run's steady state, and its peak):

* OneBitAdam: both errors, only when ``d > 1`` (one rank never compresses);
* ZeroOneAdam: both errors from its first step (sized for ``d = 1`` when alone), the
  ``momentum_accumulator`` (one fp32 per element) and ``lrs`` (one float64 scalar);
* OneBitLamb: ``lamb_coeff_freeze``, ``last_factor`` and ``scaling_coeff`` (float64 scalars
  each) and, when ``d > 1``, both errors.

Every term is returned on its own so the estimator prints one line each; the sum belongs to the
``optimizer`` kind of :class:`megazero.zero.accounting.MemoryReport`, where the engine's
``memory_report()`` counts the same tensors.
"""

from __future__ import annotations

from megazero.config import OptimizerConfig
from megazero.optim.compressed import padded_numel

FP32, FP64 = 4, 8

WORKER = "1-bit worker error (fp32)"
SERVER = "1-bit server error (fp32 / dp)"
ACCUMULATOR = "0/1 Adam momentum accumulator (fp32)"
SCALARS = "1-bit per-parameter scalars (float64)"
ONEBIT_ITEMS = (WORKER, SERVER, ACCUMULATOR, SCALARS)


def onebit_state_bytes(optimizer: OptimizerConfig | None, pieces: list[int],
                       dp: int) -> dict[str, int]:
    """The extra state bytes of ``optimizer`` over master pieces of ``pieces`` elements each,
    compressed over ``dp`` ranks; empty for any optimizer outside the 1-bit family."""
    kind = optimizer.optimizer if optimizer is not None else "adamw"
    if kind not in ("onebitadam", "zerooneadam", "onebitlamb"):
        return {}
    out: dict[str, int] = {}
    world = dp if kind != "zerooneadam" or dp > 1 else 1
    if dp > 1 or kind == "zerooneadam":
        padded = [padded_numel(n, world) for n in pieces]
        out[WORKER] = FP32 * sum(padded)
        out[SERVER] = FP32 * sum(p // world for p in padded)
    if kind == "zerooneadam":
        out[ACCUMULATOR] = FP32 * sum(pieces)
        out[SCALARS] = FP64 * len(pieces)  # lrs
    if kind == "onebitlamb":
        out[SCALARS] = 3 * FP64 * len(pieces)  # lamb_coeff_freeze, last_factor, scaling_coeff
    return out
