"""FP8 formats and recipes: which 8-bit type each GEMM operand takes and how it is scaled.

Megatron's ``--fp8-format``: ``e4m3`` puts every operand in e4m3 (max 448, 3 mantissa bits);
``hybrid`` keeps inputs and weights in e4m3 and puts output gradients in e5m2 (max 57344,
2 mantissa bits), whose range suits gradients that span more binades than activations.

``--fp8-recipe`` chooses how a tensor's scale is found:

* ``tensorwise``: current scaling, one scale per tensor from the amax of that tensor now;
* ``delayed``: one scale per tensor from the amax history of earlier steps
  (``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--fp8-margin``);
* ``blockwise``: DeepSeek-V3's scheme, a scale per 1x128 tile of every activation and
  gradient row and per 128x128 block of every weight;
* ``mxfp8``: the microscaling format of Blackwell's tensor cores; refused where no such GPU is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.errors import ConfigError

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
AMAX_ALGOS = ("most_recent", "max")
#: DeepSeek-V3's tile: activations and gradients per 1 x BLOCK, weights per BLOCK x BLOCK.
BLOCK = 128

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


@dataclass(frozen=True)
class FP8Recipe:
    """The FP8 settings a GEMM needs; built from the run's precision config."""

    fp8_format: str = "hybrid"
    recipe: str = "tensorwise"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0
    block: int = BLOCK
    # weight scales rounded down to powers of two (--fp8-param-gather: see
    # megazero.fp8.param_gather for why that makes an FP8-gathered weight lossless)
    pow2_weight_scales: bool = False

    def __post_init__(self) -> None:
        if self.fp8_format not in FORMATS:
            raise ConfigError(f"--fp8-format {self.fp8_format}: expected one of {FORMATS}")
        if self.recipe not in RECIPES:
            raise ConfigError(f"--fp8-recipe {self.recipe}: expected one of {RECIPES}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ConfigError(f"--fp8-amax-compute-algo {self.amax_compute_algo}: expected one "
                              f"of {AMAX_ALGOS}")
        if self.amax_history_len < 1 or self.margin < 0 or self.block < 1:
            raise ConfigError(f"--fp8-amax-history-len {self.amax_history_len} must be >= 1 "
                              f"and --fp8-margin {self.margin} >= 0")

    @property
    def forward_dtype(self) -> torch.dtype:
        """Inputs and weights."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """Output gradients: e5m2 under ``hybrid``, e4m3 under ``e4m3``."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def describe(self) -> str:
        extra = ""
        if self.recipe == "delayed":
            extra = (f", amax history {self.amax_history_len} ({self.amax_compute_algo}), "
                     f"margin {self.margin}")
        elif self.recipe == "blockwise":
            extra = f", 1x{self.block} activation tiles, {self.block}x{self.block} weight blocks"
        return f"{self.fp8_format} format, {self.recipe} scaling{extra}"


def check_device_supports(recipe: FP8Recipe, device: torch.device) -> None:
    """mxfp8 needs Blackwell's block-scaled GEMMs (compute capability 10 or newer); the other
    recipes run anywhere torch has float8 types (the GEMM falls back to dequantise-and-matmul
    where ``torch._scaled_mm`` does not take the operands)."""
    if recipe.recipe != "mxfp8":
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10:
        raise ConfigError("--fp8-recipe mxfp8: megazero has no MXFP8 GEMM yet; use "
                          "--fp8-recipe tensorwise, delayed or blockwise")
    raise ConfigError(f"--fp8-recipe mxfp8 needs a GPU with MXFP8 tensor cores (compute "
                      f"capability 10.0, Blackwell) and this run is on {device.type}; use "
                      "--fp8-recipe tensorwise, delayed or blockwise")
