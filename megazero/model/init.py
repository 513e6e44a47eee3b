"""Layout-independent parameter initialisation that only draws this rank's shard.

Every element of every parameter's full (tp=1, unpadded) master tensor has a fixed value: a
normal drawn from a counter-based generator addressed by ``(seed, global parameter name,
flat index of the element in the full tensor)``. The global name uses global layer indices, so
layer 5 is the same tensor whether it lives in the full model or in pipeline chunk ``[4, 8)``;
a tp=4 model holds bitwise the slices of the tp=1 model. Because any element can be computed
on its own, each rank computes only the elements of its shard (column-parallel rows,
row-parallel columns, its vocab rows, its part of every block of a strided fused weight), in
chunks, so init time and host memory scale with the shard, not with the full tensor.

The generator: ``splitmix64(key + index * GOLDEN)`` gives 64 random bits per element; the high
and low 32 bits are two uniforms that Box-Muller turns into one N(0, 1) sample (computed in
fp64, stored in fp32). Torch int64 arithmetic wraps modulo 2**64 and ``>>`` is arithmetic on
negative values, so logical shifts are masked; :func:`splitmix64_reference` is the plain
Python definition the vectorised one is tested against.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from megazero.config import ModelConfig

if TYPE_CHECKING:
    from megazero.topology import ParallelTopology

_SCALED = (".linear_proj.weight", ".linear_fc2.weight")
_NORM_PARTS = ("layernorm.", "norm.")

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: elements generated per step: bounds the temporaries (a few int64/fp64 buffers of this size,
#: small enough that the allocator does not keep megabytes of freed chunks as resident memory)
CHUNK_ELEMENTS = 1 << 16


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def param_seed(seed: int, name: str) -> int:
    """The generator key of parameter ``name``: depends on the seed and the global name only."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def splitmix64_reference(key: int, index: int) -> int:
    """Unsigned 64-bit ``splitmix64(key + index * GOLDEN)``, in plain Python."""
    z = (key + index * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` sign-extends)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(key: int, index: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`splitmix64_reference` on an int64 ``index`` tensor (bit patterns as
    int64). In-place steps keep the temporaries to two buffers of ``index``'s size."""
    z = index * _signed(_GOLDEN)
    z.add_(_signed(key))
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        z.bitwise_xor_(_shr(z, shift)).mul_(_signed(mult))
    return z.bitwise_xor_(_shr(z, 31))


def normal_at(key: int, index: torch.Tensor) -> torch.Tensor:
    """N(0, 1) samples (fp64) at flat positions ``index`` of the stream ``key``."""
    bits = splitmix64(key, index)
    u1 = _shr(bits, 32).add_(1).double().mul_(2.0 ** -32)  # (0, 1]: log never sees 0
    u2 = bits.bitwise_and_(0xFFFFFFFF).double().mul_(2.0 * math.pi * 2.0 ** -32)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_())


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the unpadded tp=1 tensor that ``param`` is a shard of."""
    shape = list(param.shape)
    if getattr(param, "vocab_size", None) is not None:
        shape[0] = param.vocab_size
    elif getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def shard_indices(param: torch.Tensor, tp_rank: int, tp_size: int) -> list[torch.Tensor]:
    """For every dim of ``param``, the index in the full tensor of each local position.

    Mirrors :func:`megazero.tensor_parallel.utils.shard_tensor`: along ``partition_dim`` the
    full size is ``stride`` blocks and rank ``r`` holds part ``r`` of each block; a vocab
    parameter holds padded rows ``[r * local, (r + 1) * local)`` (rows past ``vocab_size`` are
    pad).
    """
    idx = [torch.arange(n, dtype=torch.int64) for n in param.shape]
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        dim, local = param.partition_dim, param.shape[param.partition_dim]
        stride = 1 if getattr(param, "vocab_size", None) is not None else getattr(
            param, "partition_stride", 1)
        if local % stride:
            raise ValueError(f"shard of {local} along dim {dim} is not {stride} equal blocks "
                             f"(partition_stride {stride})")
        part = local // stride  # this rank's rows of one block
        j = idx[dim]
        idx[dim] = (j // part) * (part * tp_size) + tp_rank * part + j % part
    return idx


def _std(name: str, config: ModelConfig) -> float:
    std = config.init_method_std
    if name.endswith(_SCALED):
        std = std / math.sqrt(2.0 * config.num_layers)
    return std


def init_kind(name: str) -> str:
    """``ones``/``zeros`` for norms and biases, ``normal`` for weights (by global name)."""
    leaf = name.rsplit(".", 1)[-1]
    if any(part in name for part in _NORM_PARTS):
        return "ones" if leaf == "weight" else "zeros"
    return "zeros" if leaf == "bias" else "normal"


@torch.no_grad()
def fill_normal_shard_(out: torch.Tensor, key: int, full: tuple[int, ...],
                       idx: list[torch.Tensor], std: float, valid_rows: int | None = None
                       ) -> None:
    """Write ``std * normal_at(key, flat)`` into ``out``, where ``flat`` is the row-major
    position in a tensor of shape ``full`` of the element at global indices ``idx``; dim-0
    rows ``>= valid_rows`` are zero. Works in chunks of dim-0 rows."""
    strides = [1] * len(full)
    for d in range(len(full) - 2, -1, -1):
        strides[d] = strides[d + 1] * full[d + 1]
    rest = torch.zeros((), dtype=torch.int64)  # flat offset of the trailing dims
    for d in range(1, len(full)):
        shape = [1] * (len(full) - 1)
        shape[d - 1] = -1
        rest = rest + (idx[d] * strides[d]).view(shape)
    rest = rest.reshape(-1)
    row_elems = max(rest.numel(), 1)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row_elems)
    flat_out = out.view(out.shape[0], -1) if out.dim() > 1 else out.view(-1, 1)
    for r0 in range(0, out.shape[0], rows_per_chunk):
        rows = idx[0][r0:r0 + rows_per_chunk]
        flat = (rows * strides[0]).view(-1, 1) + rest.view(1, -1)
        vals = normal_at(key, flat).mul_(std).float()  # fp32 master values
        if valid_rows is not None:
            vals.masked_fill_((rows >= valid_rows).view(-1, 1), 0.0)
        flat_out[r0:r0 + rows.numel()].copy_(vals)


@torch.no_grad()
def init_parameter_(param: torch.Tensor, name: str, config: ModelConfig, seed: int,
                    tp_rank: int = 0, tp_size: int = 1) -> None:
    """Fill ``param`` (TP rank ``tp_rank`` of ``tp_size``'s shard of global parameter ``name``)
    with its slice of the seeded full tensor, computing only the shard's elements."""
    kind = init_kind(name)
    if kind != "normal":
        param.fill_(1.0 if kind == "ones" else 0.0)
        return
    full = full_shape(param, tp_size)
    idx = shard_indices(param, tp_rank, tp_size)
    fill_normal_shard_(param, param_seed(seed, name), full, idx, _std(name, config),
                       getattr(param, "vocab_size", None))


def full_init_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int
                     ) -> torch.Tensor:
    """The full master tensor of parameter ``name``: ones/zeros for norms, zeros for biases,
    N(0, std) for weights, N(0, std/sqrt(2L)) for output projections (Megatron's scaled init).
    Used by tests and tools that need the whole tensor; ranks never build it."""
    t = torch.empty(shape)
    init_parameter_(t, name, config, seed)
    return t


def initialize_parameters(model: nn.Module, config: ModelConfig, topo: ParallelTopology,
                          seed: int) -> None:
    """Fill every parameter of ``model`` with its slice of the seeded full tensor.

    A parameter may carry ``init_name`` to be initialised as another one (the output-layer
    copy of a tied word embedding on the last pipeline stage).
    """
    for name, p in model.named_parameters():
        init_parameter_(p, getattr(p, "init_name", name), config, seed,
                        topo.tp_rank, topo.tp_size)
