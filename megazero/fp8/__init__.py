"""FP8 training: formats and recipes, quantisation with layout-independent scales, the FP8
GEMMs of a linear, delayed scaling's amax histories, and the transform that puts them into a
model's linears (:func:`megazero.fp8.apply.apply_fp8`)."""

from megazero.fp8.delayed import AmaxHistory, finish_step
from megazero.fp8.formats import BLOCK, E4M3, E5M2, FP8Recipe, check_device_supports, fp8_max
from megazero.fp8.gemm import FP8Gemm, scaled_matmul
from megazero.fp8.quantize import (
    Scaled,
    Shard,
    quantize_row_tiles,
    quantize_tensorwise,
    quantize_weight_blocks,
    scale_from_amax,
)

__all__ = [
    "BLOCK", "E4M3", "E5M2", "AmaxHistory", "FP8Gemm", "FP8Recipe", "Scaled", "Shard",
    "check_device_supports", "finish_step", "fp8_max", "quantize_row_tiles",
    "quantize_tensorwise", "quantize_weight_blocks", "scale_from_amax", "scaled_matmul",
]
