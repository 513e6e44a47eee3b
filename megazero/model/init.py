"""Layout-independent parameter initialisation that only draws this rank's shard.

Every element of every parameter's full (tp=1, unpadded) master tensor has a fixed value: a
normal drawn from a counter-based generator addressed by ``(seed, the parameter's key, flat
index in the full tensor)``. The key (the tp=1 model's parameter name with global layer
indices, e.g. ``decoder.layers.5.mlp.linear_fc1.weight``) makes layer 5 the same tensor in the
full model and in pipeline chunk ``[4, 8)``; a tp=4 model holds bitwise the slices of the
tp=1 model. Each rank computes only its shard's elements (column-parallel rows, row-parallel
columns, its vocab rows, its part of every block of a strided fused weight), in chunks.

The rule for each parameter belongs to the layer that owns it: at construction the layer
declares an :class:`InitSpec` on the parameter (``normal``, ``ones`` or ``zeros``; whether its
std is scaled by depth; its stream key). Keys are composed from names the layers declare
(:func:`declare`, :func:`scope`), not from module attribute paths, so renaming or wrapping a
submodule changes neither which rule applies nor the values drawn. A parameter without a spec
is an error, never a silent default.

Values are drawn and rounded to fp32 on the host, a chunk at a time, and each chunk is copied
into the destination wherever it lives: a model built on the meta device creates each
parameter on its device and fills it there (:mod:`megazero.model.materialize`), and ZeRO stage 3
fills only its partition of each unit (:func:`fill_flat_range_`, :class:`ParamInitializer`).

The generator: ``splitmix64(key + index * GOLDEN)`` gives 64 random bits per element; the high
and low 32 bits are two uniforms that Box-Muller turns into one N(0, 1) sample (computed in
fp64, stored in fp32). Torch int64 arithmetic wraps modulo 2**64 and ``>>`` is arithmetic on
negative values, so logical shifts are masked; :func:`splitmix64_reference` is the plain
Python definition the vectorised one is tested against.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.distributed.host_resident import host_empty
from megazero.errors import MegazeroError
from megazero.tensor_parallel.utils import shard_rank_size

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology

KINDS = ("normal", "ones", "zeros")

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


class _Workspace:
    """The generator's host scratch buffers, reused by every chunk of every parameter while
    :func:`workspace` is held (a whole model's initialisation), freed when it is left. Fresh
    temporaries per chunk would leave resident heap gaps between the parameters (glibc raises
    its mmap threshold after the first half-megabyte one is freed: ~24 MiB kept after a
    68 MiB tp=8 shard, measured)."""

    def __init__(self) -> None:
        self.size = 0
        self.depth = 0
        self.bufs: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.size, self.bufs = 0, {}

    def get(self, n: int) -> dict[str, torch.Tensor]:
        if n > self.size:
            self.size = max(n, CHUNK_ELEMENTS)
            self.bufs = {k: host_empty(self.size, dt) for k, dt in (
                ("z", torch.int64), ("t", torch.int64), ("a", torch.int64), ("b", torch.int64),
                ("c", torch.int64), ("u", torch.float64), ("v", torch.float64),
                ("f", torch.float32), ("pad", torch.bool))}
        return {k: v[:n] for k, v in self.bufs.items()}


_WS = _Workspace()


def workspace() -> contextlib.AbstractContextManager[None]:
    """Hold the generator's scratch buffers across many fills (one allocation in all)."""
    return _WS.held()


def _shr(z: torch.Tensor, s: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` sign-extends)."""
    if out is None:
        return (z >> s) & ((1 << (64 - s)) - 1)
    torch.bitwise_right_shift(z, s, out=out)
    return out.bitwise_and_((1 << (64 - s)) - 1)


def splitmix64(key: int, index: torch.Tensor, ws: dict[str, torch.Tensor] | None = None
               ) -> torch.Tensor:
    """Vectorised :func:`splitmix64_reference` on an int64 ``index`` tensor (bit patterns as
    int64). With ``ws`` (buffers of ``index``'s numel) it allocates nothing."""
    shape = index.shape
    if ws is None:
        ws = {"z": torch.empty(index.numel(), dtype=torch.int64),
              "t": torch.empty(index.numel(), dtype=torch.int64)}
    z, t = ws["z"].view(shape), ws["t"].view(shape)
    torch.mul(index, _signed(_GOLDEN), out=z)
    z.add_(_signed(key))
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        z.bitwise_xor_(_shr(z, shift, t)).mul_(_signed(mult))
    return z.bitwise_xor_(_shr(z, 31, t))


def normal_at(key: int, index: torch.Tensor, ws: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:
    """N(0, 1) samples (fp64) at flat positions ``index`` of the stream ``key``. With ``ws``
    the result is a view of ``ws["u"]`` (valid until the next call)."""
    n = index.numel()
    if ws is None:
        ws = {k: torch.empty(n, dtype=dt) for k, dt in (
            ("z", torch.int64), ("t", torch.int64), ("u", torch.float64),
            ("v", torch.float64))}
    bits = splitmix64(key, index, ws)
    u1, u2 = ws["u"].view(index.shape), ws["v"].view(index.shape)
    u1.copy_(_shr(bits, 32, ws["t"].view(index.shape)).add_(1))
    u1.mul_(2.0 ** -32)  # (0, 1]: log never sees 0
    u2.copy_(bits.bitwise_and_(0xFFFFFFFF)).mul_(2.0 * math.pi * 2.0 ** -32)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_())


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the unpadded tp=1 tensor that ``param`` is a shard of."""
    _, tp_size = shard_rank_size(param, 0, tp_size)
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
    idx = [torch.arange(n, dtype=torch.int64, device="cpu") for n in param.shape]
    tp_rank, tp_size = shard_rank_size(param, tp_rank, tp_size)
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


@dataclass(frozen=True)
class InitSpec:
    """How one parameter is initialised. ``key`` names its random stream (with the seed): the
    global identity of the tensor, e.g. ``decoder.layers.5.mlp.linear_fc1.weight``, composed
    by the layers as they are nested (:func:`scope`). ``depth_scaled``: std is
    ``init_method_std / sqrt(2 * num_layers)`` (Megatron's output-projection init)."""

    kind: str = "normal"
    depth_scaled: bool = False
    key: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"InitSpec kind {self.kind!r}: expected one of {KINDS}")

    def std(self, config: ModelConfig) -> float:
        std = config.init_method_std
        return std / math.sqrt(2.0 * config.num_layers) if self.depth_scaled else std


def declare(param: torch.Tensor | None, kind: str = "normal", *, depth_scaled: bool = False,
            key: str) -> None:
    """Attach the init rule of ``param`` (a no-op for ``None``: an absent bias)."""
    if param is not None:
        param.init_spec = InitSpec(kind, depth_scaled, key)


def declare_linear(layer: nn.Module, *, depth_scaled: bool = False) -> nn.Module:
    """A linear layer's rule: N(0, std) weight (depth-scaled for output projections), zero
    bias. Returns ``layer``."""
    declare(layer.weight, "normal", depth_scaled=depth_scaled, key="weight")
    declare(getattr(layer, "bias", None), "zeros", key="bias")
    return layer


def declare_norm(norm: nn.Module, zero_centred: bool = False) -> nn.Module:
    """A norm's rule: unit weight (zero when it is applied as ``1 + weight``), zero bias.
    Returns ``norm``."""
    declare(norm.weight, "zeros" if zero_centred else "ones", key="weight")
    declare(getattr(norm, "bias", None), "zeros", key="bias")
    return norm


def scope(module: nn.Module, name: str) -> nn.Module:
    """Prefix ``name.`` to the keys of every parameter under ``module``: a parent calls it
    once per child with the name it gives that child (independent of the attribute it is
    stored under). Returns ``module``."""
    for p in module.parameters():
        spec = getattr(p, "init_spec", None)
        if isinstance(spec, InitSpec):  # one without a rule fails at init, by its name
            p.init_spec = replace(spec, key=f"{name}.{spec.key}" if spec.key else name)
    return module


def spec_of(param: torch.Tensor, where: str = "") -> InitSpec:
    spec = getattr(param, "init_spec", None)
    if not isinstance(spec, InitSpec):
        raise MegazeroError(
            f"parameter {where or tuple(param.shape)} declares no init rule: the layer that "
            "creates it must call megazero.model.init.declare (or declare_linear / "
            "declare_norm) so its initialisation does not depend on its name")
    return spec


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
    rest = torch.zeros((), dtype=torch.int64, device="cpu")  # offset of the trailing dims
    for d in range(1, len(full)):
        shape = [1] * (len(full) - 1)
        shape[d - 1] = -1
        rest = rest + (idx[d] * strides[d]).view(shape)
    with _WS.held():
        _fill_rows(out, key, strides, idx, rest.reshape(-1), std, valid_rows)


def _to_fp32(vals: torch.Tensor, ws: dict[str, torch.Tensor], dest: torch.Tensor
             ) -> torch.Tensor:
    """A chunk's fp64 values rounded to fp32 on the host whatever the destination (a device
    parameter gets the host's rounding bit for bit), then copied there one chunk at a time."""
    if dest.dtype == torch.float32 and dest.device.type == "cpu":
        return vals  # the copy into ``dest`` rounds, here
    return ws["f"][:vals.numel()].view(vals.shape).copy_(vals)


def _fill_rows(out: torch.Tensor, key: int, strides: list[int], idx: list[torch.Tensor],
               rest: torch.Tensor, std: float, valid_rows: int | None) -> None:
    row_elems = max(rest.numel(), 1)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row_elems)
    flat_out = out.view(out.shape[0], -1) if out.dim() > 1 else out.view(-1, 1)
    for r0 in range(0, out.shape[0], rows_per_chunk):
        rows = idx[0][r0:r0 + rows_per_chunk]
        ws = _WS.get(rows.numel() * row_elems)
        flat = ws["a"].view(rows.numel(), row_elems)
        torch.add((rows * strides[0]).view(-1, 1), rest.view(1, -1), out=flat)
        vals = normal_at(key, flat, ws).mul_(std)  # fp64
        if valid_rows is not None:
            vals.masked_fill_((rows >= valid_rows).view(-1, 1), 0.0)
        flat_out[r0:r0 + rows.numel()].copy_(_to_fp32(vals, ws, out))


@torch.no_grad()
def init_parameter_(param: torch.Tensor, spec: InitSpec, config: ModelConfig, seed: int,
                    tp_rank: int = 0, tp_size: int = 1, out: torch.Tensor | None = None
                    ) -> None:
    """Fill ``param`` (TP rank ``tp_rank`` of ``tp_size``'s shard of the global tensor
    ``spec.key``) with its slice of the seeded full tensor, computing only the shard's
    elements; or fill ``out`` (same shape, any device) for ``param`` on the meta device."""
    out = param if out is None else out
    if spec.kind != "normal":
        out.fill_(1.0 if spec.kind == "ones" else 0.0)
        return
    full = full_shape(param, tp_size)
    idx = shard_indices(param, tp_rank, tp_size)
    fill_normal_shard_(out, param_seed(seed, spec.key), full, idx, spec.std(config),
                       getattr(param, "vocab_size", None))


@torch.no_grad()
def fill_flat_range_(out: torch.Tensor, param: torch.Tensor, spec: InitSpec,
                     config: ModelConfig, seed: int, lo: int, tp_rank: int = 0,
                     tp_size: int = 1) -> None:
    """Write into 1-D ``out`` the values of elements ``[lo, lo + out.numel())`` of
    ``param``'s (its TP shard's) row-major flattening: exactly what
    :func:`init_parameter_` would put there, computing only those elements. ``param`` may be
    on the meta device (only its shape and partition attributes are read)."""
    if spec.kind != "normal":
        out.fill_(1.0 if spec.kind == "ones" else 0.0)
        return
    full = full_shape(param, tp_size)
    idx = shard_indices(param, tp_rank, tp_size)
    key, std = param_seed(seed, spec.key), spec.std(config)
    valid = getattr(param, "vocab_size", None)
    gstrides = [1] * len(full)
    for d in range(len(full) - 2, -1, -1):
        gstrides[d] = gstrides[d + 1] * full[d + 1]
    with _WS.held():
        _fill_range(out, key, std, valid, list(param.shape), idx, gstrides, lo)


def _fill_range(out: torch.Tensor, key: int, std: float, valid: int | None, shape: list[int],
                idx: list[torch.Tensor], gstrides: list[int], lo: int) -> None:
    for c0 in range(0, out.numel(), CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, out.numel() - c0)
        ws = _WS.get(n)
        pos, flat, local, g = ws["t"], ws["a"], ws["b"], ws["c"]
        torch.arange(lo + c0, lo + c0 + n, dtype=torch.int64, out=pos)
        flat.zero_()
        for d in range(len(shape) - 1, -1, -1):
            torch.remainder(pos, shape[d], out=local)
            torch.index_select(idx[d], 0, local, out=g)  # global index along dim d
            if d == 0 and valid is not None:
                torch.ge(g, valid, out=ws["pad"])
            flat.add_(g, alpha=gstrides[d])
            pos.floor_divide_(shape[d])
        vals = normal_at(key, flat, ws).mul_(std)
        if valid is not None:
            vals.masked_fill_(ws["pad"], 0.0)
        out[c0:c0 + n].copy_(_to_fp32(vals, ws, out))


def full_init_tensor(spec: InitSpec, shape: tuple[int, ...], config: ModelConfig, seed: int
                     ) -> torch.Tensor:
    """The full master tensor a spec describes. Used by tests and tools that need the whole
    tensor; ranks never build it."""
    t = torch.empty(shape)
    init_parameter_(t, spec, config, seed)
    return t


@dataclass(frozen=True)
class ParamInitializer:
    """What filling any element of a rank's parameters needs besides the parameter itself:
    handed to ZeRO stage 3 with a model built on the meta device, which then materialises
    only this rank's partition of each unit. ``device``: where the materialised tensors go."""

    config: ModelConfig
    seed: int
    tp_rank: int
    tp_size: int
    device: torch.device

    def fill_flat_(self, out: torch.Tensor, param: torch.Tensor, lo: int) -> None:
        """``out`` (1-D, any dtype/device) gets flat elements ``[lo, lo + out.numel())``,
        rounded to fp32 first (then to ``out``'s dtype), one host chunk at a time."""
        if out.numel() == 0:
            return
        fill_flat_range_(out, param, spec_of(param), self.config, self.seed, lo,
                         self.tp_rank, self.tp_size)


def initialize_parameters(model: nn.Module, config: ModelConfig, topo: ParallelTopology,
                          seed: int) -> None:
    """Fill every parameter of ``model`` with its slice of the seeded full tensor, by the rule
    its layer declared. Parameters on the meta device are only checked for a rule: they are
    filled later, partition by partition (:class:`ParamInitializer`)."""
    with workspace():
        for name, p in model.named_parameters():
            spec = spec_of(p, name)
            if not p.is_meta:
                init_parameter_(p, spec, config, seed, topo.tp_rank, topo.tp_size)
