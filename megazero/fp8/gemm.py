"""The FP8 GEMMs of one linear: forward, input gradient and weight gradient.

:class:`FP8Gemm` has the interface of the linears' GEMM seam
(:class:`megazero.tensor_parallel.layers.Gemm`): ``fprop(x, w, bias)``, ``dgrad(dy, w)`` and
``wgrad(dy, x)``. Each quantises its operands itself (inputs and weights in e4m3, output
gradients in e5m2 under ``hybrid``), multiplies, and returns the product in the input's dtype
after fp32 accumulation. Quantising again in the backward instead of saving the FP8 copies
costs a cast but keeps the seam stateless: a weight gradient deferred to later (zero-bubble
pipelines) quantises the same tensors to the same values, because every scale is a function of
the tensor (current scaling) or fixed for the step (delayed scaling).

The product runs through ``torch._scaled_mm`` where the operands have one scale each and the
kernel takes them (CPU in torch >= 2.5, Hopper and newer); otherwise the operands are
dequantised and multiplied in fp32, which computes the same function (tile scales, other
hardware).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megazero.distributed.collectives import Group
from megazero.fp8.delayed import AmaxHistory
from megazero.fp8.formats import FP8Recipe
from megazero.fp8.quantize import (
    Scaled,
    Shard,
    quantize_row_tiles,
    quantize_tensorwise,
    quantize_weight_blocks,
)
from megazero.tensor_parallel.layers import Gemm

#: ``torch._scaled_mm`` for tensorwise operands; tests switch it off to compare both paths.
USE_SCALED_MM = True


def scaled_matmul(a: Scaled, a_t: bool, b: Scaled, b_t: bool) -> torch.Tensor:
    """``op(a) @ op(b)`` in fp32, ``op`` transposing where ``*_t``."""
    if USE_SCALED_MM and a.tensorwise and b.tensorwise and hasattr(torch, "_scaled_mm"):
        m1 = (a.data.t() if a_t else a.data).contiguous()
        m2 = (b.data if b_t else b.data.t()).contiguous().t()  # column-major, as cuBLASLt wants
        try:
            return torch._scaled_mm(m1, m2, scale_a=a.scale.reciprocal(),
                                    scale_b=b.scale.reciprocal(), out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError):  # shapes or device the kernel refuses
            pass
    da, db = a.dequantize(), b.dequantize()
    return (da.t() if a_t else da) @ (db.t() if b_t else db)


class FP8Gemm(Gemm):
    """The FP8 GEMMs of one linear and how its operands are laid out over the ranks.

    ``x_groups`` / ``dy_groups`` / ``w_groups``: the groups a whole-tensor amax is max-reduced
    over (those that shard the tensor; replicated ones are harmless). ``x_shard`` /
    ``dy_shard``: the split of the operand's last dim (a row tile crossing ranks), ``w_shard``
    with ``w_shard_dim`` the weight's. ``rowwise``: one scale per token row for inputs and
    gradients whatever the recipe (the experts of an MoE layer, whose token batches depend on
    the layout). ``histories``: ``x``, ``w``, ``dy`` :class:`AmaxHistory` under delayed
    scaling.
    """

    def __init__(self, recipe: FP8Recipe, *, x_groups: Sequence[Group] = (),
                 dy_groups: Sequence[Group] = (), w_groups: Sequence[Group] = (),
                 x_shard: Shard | None = None, dy_shard: Shard | None = None,
                 w_shard: Shard | None = None, w_shard_dim: int = 0, rowwise: bool = False,
                 histories: dict[str, AmaxHistory] | None = None, name: str = ""):
        self.recipe = recipe
        self.x_groups, self.dy_groups, self.w_groups = tuple(x_groups), tuple(dy_groups), \
            tuple(w_groups)
        self.x_shard, self.dy_shard, self.w_shard = x_shard, dy_shard, w_shard
        self.w_shard_dim, self.rowwise = w_shard_dim, rowwise
        self.histories = histories or {}
        self.name = name
        #: the newest global amax of each operand (tensorwise / delayed), for the log line
        self.last_amax: dict[str, torch.Tensor] = {}

    # --- operands --------------------------------------------------------------------------
    def _whole(self, role: str, t: torch.Tensor, dtype: torch.dtype,
               groups: Sequence[Group]) -> Scaled:
        history = self.histories.get(role)
        if history is not None:
            q, amax = quantize_tensorwise(t, dtype, scale=history.scale)
            history.record(amax)
        else:
            pow2 = role == "w" and self.recipe.pow2_weight_scales
            q, amax = quantize_tensorwise(t, dtype, groups, pow2=pow2)
        self.last_amax[role] = amax
        return q

    def _rows(self, role: str, t: torch.Tensor, dtype: torch.dtype, groups: Sequence[Group],
              shard: Shard | None) -> Scaled:
        if self.recipe.recipe == "blockwise":
            return quantize_row_tiles(t, dtype, self.recipe.block, shard)
        if self.rowwise:
            return quantize_row_tiles(t, dtype, None, shard)
        return self._whole(role, t, dtype, groups)

    def quantize_x(self, x2: torch.Tensor) -> Scaled:
        return self._rows("x", x2, self.recipe.forward_dtype, self.x_groups, self.x_shard)

    def quantize_dy(self, dy2: torch.Tensor) -> Scaled:
        return self._rows("dy", dy2, self.recipe.backward_dtype, self.dy_groups, self.dy_shard)

    def quantize_w(self, w: torch.Tensor) -> Scaled:
        if self.recipe.recipe == "blockwise":
            return quantize_weight_blocks(w, self.recipe.forward_dtype, self.recipe.block,
                                          self.w_shard_dim, self.w_shard)
        return self._whole("w", w, self.recipe.forward_dtype, self.w_groups)

    # --- the seam ----------------------------------------------------------------------------
    def fprop(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = scaled_matmul(self.quantize_x(x2), False, self.quantize_w(w), True)
        y = y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = scaled_matmul(self.quantize_dy(dy2), False, self.quantize_w(w), False)
        return dx.to(dy.dtype).reshape(*dy.shape[:-1], w.shape[1])

    def wgrad(self, dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return scaled_matmul(self.quantize_dy(dy2), True, self.quantize_x(x2), False
                             ).to(dy2.dtype)
