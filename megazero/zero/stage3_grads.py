"""ZeRO stage 3, gradient side: each unit's gradients copied into a flat buffer once all of them
arrived, reduce-scattered over the data-parallel group into the unit's persistent gradient
shard, and the unit's gathered parameters released.

Units holding sequence-parallel or tied-embedding parameters (``Unit.kind`` set) wait: the
engine first sums their ``deferred_grads`` over the tensor-parallel or embedding group, then
``reduce_deferred`` scatters them. :class:`Stage3Grads` is the base of
:class:`megazero.zero.stage3.Stage3Params`, which owns the units and their gather/release.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.zero.comm import GroupComm, Handle
from megazero.zero.units import Unit


class Stage3Grads:
    """The gradient half of :class:`megazero.zero.stage3.Stage3Params`."""

    units: list[Unit]
    unit_of_param: dict[int, Unit]
    dp: GroupComm
    grad_dtype: torch.dtype
    device: torch.device
    overlap: bool

    def _release(self, u: Unit) -> None:
        raise NotImplementedError  # the parameter side (Stage3Params) frees the gathered unit


    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard.zero_()
            u.grad_full = None
            u.reduce_handle = None
            u.reduced = False
            u.filled = set()
            u.pending = {id(p) for p in u.params}
            for p in u.params:
                p.grad = None

    def _absorb(self, u: Unit) -> None:
        """Copy the unit's gradients into its flat buffer, applying the 1/dp of the average in
        the same pass; slots never filled are zeroed before the reduction."""
        if u.grad_full is None:
            u.grad_full = torch.empty(u.padded, dtype=self.grad_dtype, device=self.device)
        for i, (p, s, shape) in enumerate(zip(u.params, u.starts, u.shapes)):
            if p.grad is not None:
                torch.mul(p.grad.reshape(-1), 1.0 / self.dp.size,
                          out=u.grad_full[s:s + shape.numel()])
                u.filled.add(i)
                p.grad = None

    @staticmethod
    def _zero_unfilled(u: Unit) -> None:
        for i, (s, shape) in enumerate(zip(u.starts, u.shapes)):
            if i not in u.filled:
                u.full_grad()[s:s + shape.numel()].zero_()
                u.filled.add(i)
        u.full_grad()[u.numel:].zero_()

    def grad_accumulated(self, param: nn.Parameter) -> None:
        """Inside ``no_sync``: keep the gradient, release the parameters once all arrived."""
        u = self.unit_of_param[id(param)]
        u.pending.discard(id(param))
        if not u.pending:
            u.pending = {id(p) for p in u.params}
            self._release(u)

    def grad_ready(self, param: nn.Parameter) -> None:
        u = self.unit_of_param[id(param)]
        if u.reduced:
            raise RuntimeError("a gradient arrived after its unit was already reduced this "
                               "step; run earlier micro-batches inside engine.no_sync()")
        u.pending.discard(id(param))
        if u.pending:
            return
        self._absorb(u)
        self._release(u)
        if u.kind is None:
            self._reduce(u, async_op=self.overlap)

    def _reduce(self, u: Unit, async_op: bool) -> None:
        u.reduced = True
        if u.grad_full is None:
            u.grad_full = torch.zeros(u.padded, dtype=self.grad_dtype, device=self.device)
        else:
            self._zero_unfilled(u)
        h = self.dp.reduce_scatter(u.grad_shard, u.grad_full, async_op=async_op)
        u.reduce_handle = Handle(h, lambda: setattr(u, "grad_full", None))
        if not async_op:
            u.reduce_handle.wait()

    def flush(self) -> None:
        for u in self.units:
            if u.reduced or u.kind is not None:
                continue
            self._absorb(u)
            self._release(u)
            self._reduce(u, async_op=self.overlap)

    def wait(self) -> None:
        for u in self.units:
            if u.reduce_handle is not None:
                u.reduce_handle.wait()

    def absorb_deferred(self) -> None:
        for u in self.units:
            if u.kind is not None and not u.reduced:
                self._absorb(u)
                self._zero_unfilled(u)
                self._release(u)

    def deferred_grads(self, kind: str) -> list[torch.Tensor]:
        """The gradient slices of this kind's parameters (not the whole unit: its other
        parameters' gradients must not be summed)."""
        return [u.full_grad()[s:s + n] for u in self.units if not u.reduced
                for s, n, k in u.deferred if k == kind]

    def reduce_deferred(self) -> None:
        for u in self.units:
            if u.kind is not None and not u.reduced:
                self._reduce(u, async_op=False)

    def unused_params(self) -> list[nn.Parameter]:
        return [p for u in self.units if not u.reduced for p in u.params
                if id(p) in u.pending and p.grad is None]

    def held_grads(self) -> list[torch.Tensor]:
        out = [u.grad_shard for u in self.units]
        out += [u.grad_full for u in self.units if u.grad_full is not None]
        out += [p.grad for u in self.units for p in u.params if p.grad is not None]
        return out
