"""ZeRO stage 3: parameters sharded over data-parallel ranks, gathered module by module.

Every module that directly owns parameters becomes a :class:`Unit`: its parameters flattened,
padded to a multiple of dp and cut into equal shards; each rank keeps only its shard (on the host
with ``offload_param``). Hooks make the full parameters exist only while needed:

* forward pre-hook: all-gather the unit (waiting for a prefetch if one is in flight), then
  prefetch the next units in the recorded execution order, up to
  ``stage3_prefetch_bucket_size`` elements of lookahead and ``stage3_max_live_parameters``
  gathered elements in total;
* forward post-hook: release the unit unless it is reused soon (fewer than
  ``stage3_max_reuse_distance`` elements gathered before its backward) or persistent (fewer than
  ``stage3_param_persistence_threshold`` elements: kept whole, like DeepSpeed); wrap the outputs
  in an autograd function whose backward gathers the unit again before the module's backward;
* post-accumulate-grad hooks: once all of a unit's gradients exist, reduce-scatter them into
  the persistent gradient shard (asynchronously with ``overlap_comm``) and release the unit
  (:mod:`megazero.zero.stage3_grads`). Which parameters form a unit, and how a unit's partition
  is built (also from the meta device), is :mod:`megazero.zero.units`.

Parameters used outside the module that owns them (a tied embedding used by the output layer:
``chunk.shared_embedding_or_output_weight()``, or ``shared_embedding`` / ``zero_external`` set)
are gathered for the whole forward of the model
chunk instead, and released after their gradients arrive.

Under pipeline parallelism each stage's chunks are partitioned over that stage's dp group, and
the hooks fire per call, so a 1F1B schedule (several micro-batches' forwards before their
backwards, forwards and backwards interleaved) needs nothing else: every forward gathers the
units it runs, every backward's pre-backward gathers them again, and gradients of all but each
chunk's last micro-batch accumulate under ``no_sync``. The recorded order is one forward's; in
the backward it is walked in reverse, which is each backward's own order. The dp ranks of one
stage run the same schedule, so they issue the same gathers in the same order.

With ``offload_param.device: nvme`` a unit's shard lives in a swap file
(:mod:`megazero.zero.param_swap`): the prefetch path also starts reading the next units' shards
into host buffers, and a gather waits for that read before its all-gather. Every decision
that issues or skips a collective (prefetch depth, release after forward) depends on the
recorded order and the config only, never on whether a read has finished: ranks with disks of
different speeds wait for their reads, but issue the same gathers in the same order.

MoE experts whose expert-data-parallel group is not the data-parallel one are units partitioned,
gathered and reduce-scattered over ``edp`` (``expert_dp``); why the two groups' interleaved
collectives keep one order per group, as NCCL needs, is in :mod:`megazero.moe.grads`.

A released parameter keeps its Python object; only ``.data`` becomes an empty tensor, so
references held by autograd see the gathered storage again at backward time. Every gather
allocates a fresh buffer: a reused one would be overwritten under tensors autograd saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from megazero.config import ZeroConfig
from megazero.distributed.host_resident import host_empty, to_device
from megazero.errors import MegazeroError
from megazero.model.init import ParamInitializer, workspace
from megazero.zero import units as unit_ops
from megazero.zero.init_context import forget_partition, gather_partitioned, is_partitioned
from megazero.zero.offload import OffloadPlan
from megazero.zero.param_swap import ParamSwapper, plan_swapped_units
from megazero.zero.pieces import Piece
from megazero.zero.stage3_grads import Stage3Grads
from megazero.zero.units import Unit, leave_meta, unit_param_groups, unit_values, wrap_outputs

if TYPE_CHECKING:
    from megazero.distributed.group_comm import GroupComm
    from megazero.zero.optimizer import Comms


class ParamCodec(Protocol):
    """Gathers a unit's parameter in another encoding (``--fp8-param-gather``:
    :class:`megazero.fp8.param_gather.FP8ParamCodec`): ``encode`` turns this rank's shard into
    the bytes to gather (collective over ``zero_group`` and whatever else the scale needs),
    ``decode`` the gathered bytes into the parameter's dtype."""

    def encode(self, shard: torch.Tensor, zero_group: Any) -> torch.Tensor: ...

    def decode(self, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


class Stage3Params(Stage3Grads):
    """Sharded parameters of one model chunk, with the hooks that gather and release them (the
    gradient side is :class:`Stage3Grads`)."""

    def __init__(self, chunk: nn.Module, zero: ZeroConfig, comms: Comms, grad_dtype: torch.dtype,
                 kinds: dict[int, str], param_init: ParamInitializer | None = None, *,
                 expert_dp: GroupComm | None = None) -> None:
        """``param_init``: for a chunk built on the meta device, what computes any element of
        its parameters; each unit then materialises only this rank's partition (a persistent
        unit its whole flat buffer), so no rank ever holds the full model. ``expert_dp``: the
        expert-data-parallel group MoE expert units are partitioned over, where it is not
        ``comms.dp`` (module docstring)."""
        self.zero = zero
        self.dp = comms.dp
        self.expert_dp = expert_dp
        self.grad_dtype = grad_dtype
        self.overlap = zero.overlap_comm
        first = next(chunk.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.param_init = param_init
        if first.is_meta:
            if param_init is None:
                raise MegazeroError("a ZeRO stage-3 model on the meta device needs param_init "
                                    "(megazero.model.init.ParamInitializer) to materialise "
                                    "its partitions")
            self.device = param_init.device
        self.plan = OffloadPlan.from_config(zero)
        self.offload = self.plan.params
        self.units: list[Unit] = []
        self._swapped: list[Unit] = []
        self.unit_of_param: dict[int, Unit] = {}
        self.owner: dict[Unit, nn.Module] = {}  # the module whose forward gathers the unit
        self.root = chunk
        self.parent = {c: m for m in chunk.modules() for c in m.children()}
        groups = unit_param_groups(chunk)
        comms_of = [self._comm_for(ps) for ps, _ in groups]
        self.swap: ParamSwapper | None = None
        swapped = [False] * len(groups)
        if self.plan.params_nvme:
            swapped, self.swap = plan_swapped_units(
                [sum(p.numel() for p in ps) for ps, _ in groups], zero,
                [c.size for c in comms_of], self.dtype)
        with workspace():  # the init generator's scratch, shared by all units
            for (params, owner), nvme, comm in zip(groups, swapped, comms_of):
                self.owner[self._add_unit(params, kinds, nvme, comm)] = owner
        self.units_of: dict[nn.Module, list[Unit]] = {}
        self.order: list[Unit] = []
        self._pos: dict[Unit, int] = {}
        self._held_before: set[int] = set()
        self._ran: list[nn.Module] = []
        self.recording = True
        self.live = 0
        self.codecs: dict[int, ParamCodec] = {}  # unit index -> how it is gathered
        for module in chunk.modules():
            if module is not chunk:
                module.register_forward_pre_hook(self._pre_forward)
                module.register_forward_hook(self._post_forward)
        chunk.register_forward_pre_hook(self._root_pre_forward)
        chunk.register_forward_hook(self._root_post_forward)
        self.padding = sum(u.padding for u in self.units)
        self._build_grad_buckets(max(1, int(zero.reduce_bucket_size)))

    def _comm_for(self, params: list[nn.Parameter]) -> GroupComm:
        """The group a unit of ``params`` is partitioned over (``edp`` for MoE experts with a
        group of their own, else ``dp``)."""
        expert = unit_ops.unit_is_expert(params)  # refuses a unit mixing the two kinds
        return self.expert_dp if expert and self.expert_dp is not None else self.dp

    def _add_unit(self, params: list[nn.Parameter], kinds: dict[int, str], nvme: bool,
                  comm: GroupComm) -> Unit:
        for p in params:  # built inside zero.Init: gathered one unit at a time, never all
            if is_partitioned(p):
                p.data = gather_partitioned(p).to(self.dtype)
                forget_partition(p)
        n = sum(p.numel() for p in params)
        kind = next((kinds[id(p)] for p in params if id(p) in kinds), None)
        u = Unit(len(self.units), params, comm.size, comm.rank,
                 n < self.zero.stage3_param_persistence_threshold, kind)
        u.comm = comm
        # Which elements the deferred sum covers: a row-parallel linear's unit holds its
        # TP-split weight and its sequence-parallel bias; only the bias is summed over TP.
        u.deferred = [(s, p.numel(), kinds[id(p)]) for p, s in zip(params, u.starts)
                      if id(p) in kinds]
        if u.persistent:
            flat = unit_values(u, 0, u.padded, self.dtype, self.device, self.param_init)
            u.full, u.shard = flat, flat[u.own_lo:u.own_hi]
            leave_meta(params, self.dtype, self.device)
            u.attach()
        else:
            shard = unit_values(u, u.own_lo, u.own_hi, self.dtype, self.device,
                                self.param_init)
            if nvme:
                assert self.swap is not None
                u.swap = self.swap.handle(len(self._swapped), u.shard_size)
                self._swapped.append(u)
                self.swap.write_shard(u.swap.slot, shard)
                # Only shape and dtype remain; the optimizer's pieces view it (Piece.swapped).
                u.shard = torch.empty(u.shard_size, dtype=self.dtype, device="meta")
            elif self.offload:
                u.shard = host_empty(u.shard_size, self.dtype, self.plan.pin_params)
                u.shard.copy_(shard)
            else:
                u.shard = shard
            leave_meta(params, self.dtype, self.device)
            for p in params:
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        u.pending = {id(p) for p in params}
        self.units.append(u)
        for p in params:
            self.unit_of_param[id(p)] = u
        return u

    # --- gather / release ---------------------------------------------------------------------

    def _gather(self, u: Unit, async_op: bool) -> None:
        if u.full is not None or u.gather_handle is not None:
            return
        if u.swap is not None:
            assert self.swap is not None
            buf = self.swap.fetch(u.swap.slot, u.shard_size)
            # A copy, so the buffer goes back now: the collective may read its input later.
            src = buf.to(self.device, copy=True)
            self.swap.give_back(buf)
        else:
            src = to_device(u.shard, self.device, non_blocking=True)
        codec = self.codecs.get(u.index)
        if codec is not None:  # encoded, gathered and decoded at once (not overlapped)
            payload = codec.encode(src, u.comm.group)
            gathered = torch.empty(u.padded, dtype=payload.dtype, device=self.device)
            u.comm.all_gather(gathered, payload)
            u.full = codec.decode(gathered, self.dtype)
            self.live += u.padded
            u.attach()
            return
        u.full = torch.empty(u.padded, dtype=self.dtype, device=self.device)
        u.gather_handle = u.comm.all_gather(u.full, src, async_op=async_op)
        self.live += u.padded

    def _ensure(self, u: Unit) -> None:
        self._gather(u, async_op=False)
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
            u.attach()

    def _release(self, u: Unit) -> None:
        if u.persistent or u.full is None:
            return
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
        for p in u.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        u.full = None
        self.live -= u.padded

    def _prefetch(self, pos: int, direction: int) -> None:
        budget = self.zero.stage3_prefetch_bucket_size
        i = pos + direction
        while 0 <= i < len(self.order) and budget > 0:
            u = self.order[i]
            if u.full is None and not u.persistent:
                if self.live + u.padded > self.zero.stage3_max_live_parameters:
                    break
                # Stop where no read was started (no spare buffer: the same on every rank); a
                # read on the way is waited for. Stopping there too would tie the prefetch
                # depth, ``live`` and the release decisions to this rank's disk (module doc).
                if u.swap is not None and not self._swapper().requested(u.swap.slot):
                    break
                self._gather(u, async_op=True)
                budget -= u.padded
            i += direction
        if self.swap is not None:
            self._read_ahead(i, direction)

    def _read_ahead(self, i: int, direction: int) -> None:
        """Start reading the next swapped shards into free buffers, in execution order, so
        their bytes arrive while earlier modules compute."""
        while 0 <= i < len(self.order):
            u = self.order[i]
            if u.swap is not None and u.full is None and u.gather_handle is None:
                if not self._swapper().prefetch(u.swap.slot, u.shard_size):
                    return
            i += direction

    def _swapper(self) -> ParamSwapper:
        assert self.swap is not None  # only units with a swap handle ask (offload_param nvme)
        return self.swap

    def _reuse_distance(self, u: Unit) -> float:
        """Elements gathered between this unit's forward and its backward (rest of the forward
        and the start of the backward both touch every later unit)."""
        if u not in self._pos:
            return float("inf")
        return 2 * sum(v.padded for v in self.order[self._pos[u] + 1:])

    # --- hooks --------------------------------------------------------------------------------

    def _finish_recording(self) -> None:
        """After the first forward: a unit whose module never ran its own forward (a parent
        reads the parameter directly, like a position-embedding table) is gathered by the
        nearest ancestor that did run; the execution order drives prefetch and reuse."""
        ran = set(self._ran)
        for u, m in self.owner.items():
            while m is not self.root and m not in ran:
                m = self.parent[m]
            self.owner[u] = m
        for u, m in self.owner.items():
            self.units_of.setdefault(m, []).append(u)
        self.order = [u for m in self._ran for u in self.units_of.get(m, [])]
        self._pos = {u: i for i, u in enumerate(self.order)}
        self.recording = False

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        # The first forward runs with everything gathered while it records who uses what.
        if self.swap is not None and not self.recording:
            self._read_ahead(0, +1)
        for u in self.units if self.recording else self.units_of.get(self.root, []):
            self._ensure(u)

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.recording:
            self._finish_recording()
            for u in self.units:
                if self.owner[u] is not self.root:
                    self._post_forward_unit(u)
        mine = self.units_of.get(self.root, [])
        # The root's units (a tied output embedding) are the first used by the backward: reuse
        # distance 0, so they stay gathered unless stage3_max_reuse_distance is 0.
        keep = (self.zero.stage3_max_reuse_distance > 0
                and self.live <= self.zero.stage3_max_live_parameters)
        for u in mine:
            if not keep or not torch.is_grad_enabled():
                self._release(u)
        if torch.is_grad_enabled() and mine:
            return wrap_outputs(output, lambda: self._pre_backward(self.root))
        return None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.recording:
            if module not in self._ran:
                self._ran.append(module)
            return
        # A forward inside the backward is activation recomputation: the units that follow in
        # forward order already ran their backward, so prefetching them would gather weights
        # no one needs (and, held past the optimizer step, stale ones).
        recomputing = torch._C._current_graph_task_id() != -1
        for u in self.units_of.get(module, ()):
            self._ensure(u)
            if not recomputing:
                self._prefetch(self._pos[u], +1)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.recording:
            return wrap_outputs(output, lambda: self._pre_backward(module)) if (
                torch.is_grad_enabled()) else None
        units = self.units_of.get(module)
        if not units:
            return None
        for u in units:
            self._post_forward_unit(u)
        if torch.is_grad_enabled():
            return wrap_outputs(output, lambda: self._pre_backward(module))
        return None

    def _post_forward_unit(self, u: Unit) -> None:
        keep = (self._reuse_distance(u) < self.zero.stage3_max_reuse_distance
                and self.live <= self.zero.stage3_max_live_parameters)
        if not keep or not torch.is_grad_enabled():
            self._release(u)

    def _pre_backward(self, module: nn.Module) -> None:
        for u in self.units_of.get(module, ()):
            self._ensure(u)
            if u in self._pos:
                self._prefetch(self._pos[u], -1)

    # --- optimizer side -----------------------------------------------------------------------

    def params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    def pieces(self) -> list[Piece]:
        out = []
        for u in self.units:
            for p, s, shape in zip(u.params, u.starts, u.shapes):
                lo, hi = max(s, u.own_lo), min(s + shape.numel(), u.own_hi)
                if lo < hi:
                    a, b = lo - u.own_lo, hi - u.own_lo
                    out.append(Piece(p, u.shard[a:b], u.grad_shard[a:b], ndim=len(shape),
                                     offset=lo - s,
                                     swapped=None if u.swap is None else (u.swap, a)))
        return out

    def after_step(self, chunk: int | None, use_broadcast: bool) -> None:
        """Persistent units hold full parameters: refresh them from the updated shards, one
        all-gather per group (:func:`~megazero.zero.units.refresh_persistent`). Any other unit
        still gathered holds the weights from before the step: released, so the
        next forward gathers the updated ones."""
        for u in self.units:
            self._release(u)
        for comm in (self.dp, self.expert_dp):  # dense first, then experts: the same on all
            if comm is not None:
                pers = [u for u in self.units if u.persistent and u.comm is comm]
                unit_ops.refresh_persistent(pers, comm, chunk)

    def held_params(self) -> dict[str, list[torch.Tensor]]:
        shards = [u.shard for u in self.units if not u.persistent and u.swap is None]
        full = [u.full for u in self.units if u.full is not None]
        if self.offload:  # NVMe: the host buffers shards stream through
            return {"device": full, "offload": shards + ([self.swap.pool] if self.swap else [])}
        return {"device": full + shards}

    def param_shapes(self) -> dict[int, torch.Size]:
        return {id(p): shape for u in self.units for p, shape in zip(u.params, u.shapes)}

    def gather_with(self, codecs: dict[int, ParamCodec]) -> int:
        """Gather the units that hold exactly one of these parameters (``id(param)`` ->
        codec), and are not persistent, through its codec; returns how many units do."""
        for u in self.units:
            if len(u.params) == 1 and id(u.params[0]) in codecs and not u.persistent:
                self.codecs[u.index] = codecs[id(u.params[0])]
        return len(self.codecs)

    def gather_all(self) -> None:
        self._held_before = {u.index for u in self.units if u.full is not None}
        for u in self.units:
            self._ensure(u)

    def release_all(self, write_back: bool = False) -> None:
        for u in self.units:
            if write_back and u.full is not None and not u.persistent:
                if u.swap is not None:
                    self._swapper().write_shard(u.swap.slot, u.full[u.own_lo:u.own_hi])
                else:
                    u.shard.copy_(u.full[u.own_lo:u.own_hi])
        for u in self.units:
            if u.index not in self._held_before:
                self._release(u)

    def gather_params(self, params: list[nn.Parameter]) -> list[tuple[Unit, bool]]:
        """Gather the units holding ``params`` (for ``zero.GatheredParameters``); returns
        what :meth:`release_params` needs: each unit and whether it was already gathered."""
        units = {self.unit_of_param[id(p)].index: self.unit_of_param[id(p)] for p in params}
        held = [(u, u.full is not None) for u in units.values()]
        for u, _ in held:
            self._ensure(u)
        return held

    def release_params(self, held: list[tuple[Unit, bool]], write_back: bool) -> None:
        for u, was in held:
            if write_back and not u.persistent:
                u.shard.copy_(u.gathered()[u.own_lo:u.own_hi])
            if not was:
                self._release(u)

    def gathered_state(self) -> dict[int, torch.Tensor]:
        """Full copies of every parameter (collective over dp), keyed by ``id(param)``."""
        out = {}
        for u in self.units:
            was = u.full is not None
            self._ensure(u)
            for p in u.params:
                out[id(p)] = p.detach().clone()
            if not was:
                self._release(u)
        return out
