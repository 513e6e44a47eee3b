"""Stage-3 building blocks: which parameters form a unit, a unit's flattened, sharded parameters
(its partition built from full parameters or, on the meta device, computed element by element),
and the autograd identity that lets a module gather its parameters again right before its
backward runs."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megazero.distributed.group_comm import Handle
from megazero.errors import MegazeroError
from megazero.model.init import ParamInitializer

if TYPE_CHECKING:
    from megazero.distributed.group_comm import GroupComm


class Unit:
    """One module's directly owned parameters, flattened and padded to a multiple of dp: this
    rank owns elements ``[own_lo, own_hi)``; ``full`` exists only while gathered."""

    def __init__(self, index: int, params: list[nn.Parameter], dp_size: int, dp_rank: int,
                 persistent: bool, kind: str | None) -> None:
        self.index = index
        self.params = params
        self.shapes = [p.shape for p in params]
        self.starts: list[int] = []
        n = 0
        for p in params:
            self.starts.append(n)
            n += p.numel()
        self.numel = n
        self.padded = -(-n // dp_size) * dp_size
        self.padding = self.padded - n
        self.shard_size = self.padded // dp_size
        self.own_lo, self.own_hi = dp_rank * self.shard_size, (dp_rank + 1) * self.shard_size
        self.persistent = persistent
        self.kind = kind  # a deferred kind ("sp", "emb") when any parameter has one
        self.deferred: list[tuple[int, int, str]] = []  # (start, numel, kind) of those params
        self.full: torch.Tensor | None = None
        self.shard = torch.empty(0)  # this rank's shard (Stage3Params sets it)
        self.gather_handle: Handle | None = None
        self.grad_shard = torch.empty(0)  # the reduced gradient shard (Stage3Params sets it)
        self.bucket: GradBucket  # where its gradients are reduced (set by GradBucket)
        self.column = 0  # where its chunk starts in each row of that bucket
        self.pending: set[int] = set()
        self.filled: set[int] = set()  # indices of params copied into its bucket this step
        self.counted = False  # in its bucket's current round (stage3_grads: _commit)
        self.reduced = False
        self.swap: Any = None  # NVMe offload: the UnitSwap holding the shard (param_swap.py)
        # The group the unit is partitioned, gathered and reduce-scattered over: the data-
        # parallel one, or for MoE experts their expert-data-parallel one (Stage3Params sets
        # it; :func:`unit_is_expert`).
        self.comm: GroupComm

    def gathered(self) -> torch.Tensor:
        """The full (padded) parameters; they exist only while the unit is gathered."""
        if self.full is None:
            raise RuntimeError(f"stage-3 unit {self.index} is not gathered")
        return self.full

    def attach(self) -> None:
        """Point every parameter at its slice of the gathered buffer."""
        full = self.gathered()
        for p, s, shape in zip(self.params, self.starts, self.shapes):
            p.data = full[s:s + shape.numel()].view(shape)


class GradBucket:
    """Consecutive units whose gradients are reduce-scattered together. ``shard`` is the flat
    persistent gradient shard of all of them (each unit's ``grad_shard`` is a view into it);
    ``full`` (``dp x width``, row-major) exists from the first absorbed unit until the
    collective finished."""

    def __init__(self, units: list[Unit], dp: int, dtype: torch.dtype,
                 device: torch.device, comm: GroupComm | None = None) -> None:
        self.units = units
        self.dp = dp
        self.comm = comm  # the units' group (Unit.comm); None: the store's dp
        self.width = sum(u.shard_size for u in units)
        self.shard = torch.zeros(self.width, dtype=dtype, device=device)
        self.full: torch.Tensor | None = None
        self.handle: Handle | None = None
        self.absorbed = 0
        self.launched = False
        self.reductions = 0  # launched this step
        col = 0
        for u in units:
            u.bucket, u.column = self, col
            u.grad_shard = self.shard[col:col + u.shard_size]
            col += u.shard_size

    def numel(self) -> int:
        return self.dp * self.width

    def rows(self, dtype: torch.dtype, device: torch.device, zeroed: bool = False
             ) -> torch.Tensor:
        """The ``dp x width`` input, allocated on first use (every column is written or
        zeroed before the launch; ``zeroed``: filled with zeros, to add gradients into)."""
        if self.full is None:
            alloc = torch.zeros if zeroed else torch.empty
            self.full = alloc(self.numel(), dtype=dtype, device=device)
        return self.full.view(self.dp, self.width)

    def free(self) -> None:
        self.full = None


def refresh_persistent(units: list[Unit], comm: GroupComm, chunk: int | None) -> None:
    """Persistent units hold full parameters: refresh them from their updated shards, all in
    one all-gather over their group (they are small and many: one collective each would be
    latency-bound)."""
    if not units or comm.size == 1:
        return
    shards = torch.cat([u.shard for u in units])
    out = torch.empty(comm.size * shards.numel(), dtype=shards.dtype, device=shards.device)
    comm.all_gather(out, shards, chunk=chunk)
    rows, pos = out.view(comm.size, -1), 0
    for u in units:
        u.gathered().view(comm.size, u.shard_size).copy_(rows[:, pos:pos + u.shard_size])
        pos += u.shard_size


def unit_param_groups(chunk: nn.Module) -> list[tuple[list[nn.Parameter], nn.Module]]:
    """The parameter groups stage 3 partitions and gathers as one unit each, with the module whose
    forward gathers it: a module's own parameters together, except those used outside it (the
    tied word embedding, shared embedding copies, parameters marked ``zero_external``), which
    are units of their own gathered around the whole chunk. The planner replays the same
    grouping (:mod:`megazero.planner.model_states`)."""
    tied = getattr(chunk, "shared_embedding_or_output_weight", None)
    tied = tied() if callable(tied) else None
    groups: list[tuple[list[nn.Parameter], nn.Module]] = []
    seen: set[int] = set()  # a parameter registered in two modules (tied weights) goes once
    for module in chunk.modules():
        own = [p for p in module.parameters(recurse=False)
               if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        ext = [p for p in own if p is tied or getattr(p, "shared_embedding", False)
               or getattr(p, "zero_external", False)]
        rest = [p for p in own if all(p is not e for e in ext)]
        if rest:
            groups.append((rest, module))
        groups.extend(([p], chunk) for p in ext)
    return groups


def unit_is_expert(params: list[nn.Parameter]) -> bool:
    """Whether a unit holds MoE expert parameters (``param.expert``): those are replicated over
    the expert-data-parallel group, not the data-parallel one, so a unit is partitioned over
    one or the other and must not mix them (each expert's ``linear_fc1``/``linear_fc2`` is a
    module of its own, so megazero's models never do)."""
    flags = {bool(getattr(p, "expert", False)) for p in params}
    if len(flags) > 1:
        shapes = [(tuple(p.shape), bool(getattr(p, "expert", False))) for p in params]
        raise MegazeroError(
            f"a ZeRO stage-3 unit (one module's own parameters) mixes MoE expert and dense "
            f"parameters {shapes}: experts are partitioned over the expert-data-parallel "
            "group and dense weights over the data-parallel one; put the expert parameters "
            "in a submodule of their own")
    return flags == {True}


class _PreBackward(torch.autograd.Function):
    """Identity whose backward runs ``callback`` first (gathers a unit before its backward)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.callback()
        return None, grad


def wrap_outputs(output: Any, callback: Any) -> Any:
    """Route every tensor of a module's output through :class:`_PreBackward`."""
    if isinstance(output, torch.Tensor):
        if not output.requires_grad:
            return output
        return _PreBackward.apply(callback, output)  # type: ignore[no-untyped-call]  # torch stub
    if isinstance(output, tuple):
        return tuple(wrap_outputs(o, callback) for o in output)
    if isinstance(output, list):
        return [wrap_outputs(o, callback) for o in output]
    if isinstance(output, dict):
        # copy, not a new dict: keeps the output's own type (Hugging Face's ModelOutput)
        out = copy.copy(output)
        for k, v in output.items():
            out[k] = wrap_outputs(v, callback)
        return out
    return output


def unit_values(u: Unit, lo: int, hi: int, dtype: torch.dtype, device: torch.device,
                param_init: ParamInitializer | None) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the unit's padded flat buffer, built without the rest: copied
    from full parameters, or computed by ``param_init`` for parameters on the meta device."""
    out = torch.zeros(hi - lo, dtype=dtype, device=device)
    for p, s in zip(u.params, u.starts):
        a, b = max(lo, s), min(hi, s + p.numel())
        if a >= b:
            continue
        if p.is_meta:
            assert param_init is not None
            param_init.fill_flat_(out[a - lo:b - lo], p, a - s)
        else:
            out[a - lo:b - lo].copy_(p.data.reshape(-1)[a - s:b - s])
    return out


def leave_meta(params: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
    """Give meta parameters real (empty) storage on the device, keeping each Python object
    (modules, optimizer pieces and autograd hold it) and its attributes: ``.data`` cannot
    move a tensor off the meta device, so the tensors are swapped."""
    for p in params:
        if p.is_meta:
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(  # type: ignore[no-untyped-call]
                torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad))
            p.__dict__.update(attrs)
