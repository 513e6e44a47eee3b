"""Building a model already partitioned for ZeRO stage 3, and seeing full weights on demand.

``with megazero.zero.Init(): model = MyModel()`` keeps every rank from ever holding the whole
model: each ``nn.Module`` subclass's ``__init__`` is wrapped while the context is open, and when
the *outermost* ``__init__`` of a module returns (its own initialisation, ``reset_parameters``
included, has run) the parameters it owns directly are cut into ``dp`` equal flat shards; this
rank keeps its shard (``param.mz_shard``) of the first rank's values (broadcast, so ranks seeded
differently agree) and ``param.data`` becomes an empty tensor. The peak is
one module's own parameters in full, never the model. The weights are therefore exactly those of
the same model built outside the context from the same seed: each module initialises its full
tensors before they are cut, and cutting draws no random numbers. Initialisation that runs later
on the parent (a ``post_init`` that re-initialises every submodule) sees empty tensors and does
nothing, as with DeepSpeed's ``zero.Init``; put such code inside :class:`GatheredParameters`.

Why wrap ``__init__`` rather than build on the meta device and initialise shards: an arbitrary
user model initialises its weights with its own code (``reset_parameters``, ``post_init``), which
only exists as code that writes full tensors; replaying it shard by shard would need per-module
knowledge that megazero has only for its own GPT (``megazero/model/init.py``). A class that has
that knowledge says so with ``mz_meta_init = True`` (megazero's ``GPTModel``): it is built on the
meta device and each parameter's shard is computed directly
(``param_initializer(device).fill_flat_``), so not even one module exists in full.

:func:`megazero.initialize` with stage 3 turns these per-parameter shards into its per-module
units one unit at a time (:func:`gather_partitioned`), so the full model is never materialised
there either. ``GatheredParameters(params, modifier_rank)`` gathers full values inside the
context and, on exit, takes ``modifier_rank``'s values (broadcast) back into the shards (and the
engine's fp32 masters); without ``modifier_rank`` changes made inside are discarded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megazero.distributed import collectives
from megazero.distributed.host_resident import mark, to_device
from megazero.model.init import workspace

if TYPE_CHECKING:
    from megazero.zero.optimizer import ZeroOptimizer

    class PartitionedParam(nn.Parameter):
        """The attributes :func:`partition_param` and :func:`megazero.initialize` set on a
        plain ``nn.Parameter`` (a type for the checker; no parameter is of this class)."""

        mz_shard: torch.Tensor
        mz_shape: torch.Size
        mz_group: ProcessGroup | None
        mz_engine: ZeroOptimizer


def _group_info(group: ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def is_partitioned(p: torch.Tensor) -> bool:
    """Partitioned by :class:`Init` and not yet taken over by an engine."""
    return getattr(p, "mz_shard", None) is not None


def partition_param(p: nn.Parameter, group: ProcessGroup | None, device: torch.device | None,
                    dtype: torch.dtype | None) -> None:
    """Keep this rank's 1/dp flat shard of ``p`` and empty ``p.data``. The values are the
    group's first rank's (broadcast first), so ranks seeded differently still agree."""
    size, rank = _group_info(group)
    data = p.data
    if dtype is not None and data.is_floating_point():
        data = data.to(dtype)
    if size > 1:
        data = data.contiguous()
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(data, src=src, group=group)
    n = data.numel()
    per = -(-n // size)
    flat = data.reshape(-1)
    lo, hi = min(n, rank * per), min(n, (rank + 1) * per)
    shard = torch.zeros(per, dtype=data.dtype, device=device or data.device)
    if device is not None:  # remote_device: kept on the host on purpose
        mark(shard)
    shard[:hi - lo].copy_(flat[lo:hi])
    q = cast("PartitionedParam", p)
    q.mz_shard, q.mz_shape, q.mz_group = shard, data.shape, group
    p.data = torch.empty(0, dtype=data.dtype, device=data.device)


def gather_partitioned(param: nn.Parameter) -> torch.Tensor:
    """The full value of a partitioned parameter (collective over its group), on the device
    the parameter computes on: a shard kept on the host (``remote_device="cpu"``) is copied
    there first, as NCCL gathers only device tensors."""
    p = cast("PartitionedParam", param)
    group, device = p.mz_group, param.data.device  # partitioning left an empty tensor there
    shard = to_device(p.mz_shard.contiguous(), device)
    size, _ = _group_info(group)
    if size == 1:
        full = shard
    else:
        full = torch.empty(size * shard.numel(), dtype=shard.dtype, device=device)
        # None is the default (world) group here; in megazero.distributed.collectives it means "no
        # group".
        collectives.all_gather(full, shard, group if group is not None else dist.group.WORLD)
    n = torch.Size(p.mz_shape).numel()
    return full[:n].view(p.mz_shape).clone()


def forget_partition(p: nn.Parameter) -> None:
    """Drop the :class:`Init` shard once an engine owns the parameter."""
    for name in ("mz_shard", "mz_shape", "mz_group"):
        if hasattr(p, name):
            delattr(p, name)


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    todo: list[type] = [cls]
    while todo:
        subs: list[type] = todo.pop().__subclasses__()
        for sub in subs:
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


class Init:
    """Context manager: modules created inside have their parameters partitioned over
    ``data_parallel_group`` (default: the whole world). ``dtype`` casts floating parameters;
    ``remote_device="cpu"`` keeps the shards in host memory. ``enabled=False`` does nothing."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 remote_device: str | None = None, dtype: torch.dtype | None = None,
                 enabled: bool = True, config_dict_or_path: Any = None, **_: Any) -> None:
        self.group = data_parallel_group
        self.device = torch.device(remote_device) if remote_device not in (None, "none") \
            else None
        self.dtype = dtype
        self.enabled = enabled
        self._patched: dict[type, Any] = {}
        self._depth: dict[int, int] = {}
        self._old_init_subclass: Any = None
        if module is not None and enabled:
            self._partition_tree(module)

    def _partition_own(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if not is_partitioned(p) and not p.is_meta:  # meta: its mz_meta_init owner's job
                partition_param(p, self.group, self.device, self.dtype)

    def _partition_meta(self, module: nn.Module) -> None:
        """Compute this rank's flat shard of every meta parameter of ``module`` (an
        ``mz_meta_init`` class) from its initializer; its meta buffers are recomputed."""
        device = self.device or torch.device("cpu")
        size, rank = _group_info(self.group)
        init = module.param_initializer(device)  # type: ignore[operator]
        module.materialize_buffers(device)  # type: ignore[operator]
        with workspace():
            for p in module.parameters():
                if p.is_meta:
                    self._shard_meta(p, init, size, rank, device)

    def _shard_meta(self, p: nn.Parameter, init: Any, size: int, rank: int,
                    device: torch.device) -> None:
        n, dtype = p.numel(), self.dtype or p.dtype
        per = -(-n // size)
        lo, hi = min(n, rank * per), min(n, (rank + 1) * per)
        shard = torch.zeros(per, dtype=dtype, device=device)
        init.fill_flat_(shard[:hi - lo], p, lo)
        shape, attrs = p.shape, dict(p.__dict__)
        torch.utils.swap_tensors(  # type: ignore[no-untyped-call]  # unannotated in torch
            p, nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                            requires_grad=p.requires_grad))
        p.__dict__.update(attrs)
        q = cast("PartitionedParam", p)
        q.mz_shard, q.mz_shape, q.mz_group = shard, shape, self.group

    def _partition_tree(self, module: nn.Module) -> None:
        for m in module.modules():
            self._partition_own(m)

    def _wrap(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or cls in self._patched:
            return
        orig = cls.__dict__["__init__"]
        ctx = self

        @functools.wraps(orig)
        def init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            meta = getattr(cls, "mz_meta_init", False) and ctx._depth[key] == 1
            try:
                with torch.device("meta") if meta else contextlib.nullcontext():
                    orig(module, *args, **kwargs)
            finally:
                ctx._depth[key] -= 1
            if ctx._depth[key] == 0:
                del ctx._depth[key]
                if meta:
                    ctx._partition_meta(module)
                ctx._partition_own(module)

        self._patched[cls] = orig
        cls.__init__ = init  # type: ignore[misc]  # patching constructors is what Init does

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in _all_subclasses(nn.Module):
            self._wrap(cls)
        self._old_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        ctx = self

        def init_subclass(cls: type[nn.Module], /, **kwargs: Any) -> None:  # classes defined inside
            super(nn.Module, cls).__init_subclass__(**kwargs)
            ctx._wrap(cls)

        # a classmethod replacing a method: the run-time patch mypy cannot express
        nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for cls, orig in self._patched.items():
            cls.__init__ = orig  # type: ignore[misc]  # restoring the patched constructors
        self._patched.clear()
        if self._old_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._old_init_subclass  # type: ignore[method-assign]


def _replica_group(p: nn.Parameter) -> ProcessGroup | None:
    """The group over which ``p``'s full value is replicated (None: the world): its
    :class:`Init` group, else its engine's data-parallel group, or for a MoE expert with a
    group of its own the expert-data-parallel one (where its ZeRO shards live)."""
    group = getattr(p, "mz_group", None)
    if group is not None:
        return cast("ProcessGroup", group)
    store = getattr(p, "mz_stage3_store", None)
    if store is not None:  # stage 3: the group its unit is partitioned over
        return cast("ProcessGroup | None", store.unit_of_param[id(p)].comm.group)
    engine = getattr(p, "mz_engine", None)
    if engine is None:
        return None
    from megazero.moe.grads import experts_need_own_group, is_expert

    if is_expert(p) and experts_need_own_group(engine.topo):
        return cast("ProcessGroup | None", engine.topo.edp_group)
    return cast("ProcessGroup | None", engine.comms.dp.group)


class GatheredParameters:
    """Inside, each of ``params`` holds its full value, whether it is partitioned by
    :class:`Init` or by a stage-3 engine (a no-op for unpartitioned parameters). On exit with
    ``modifier_rank`` set, that rank's values are broadcast and written back into every rank's
    shard (and the engine's fp32 masters); otherwise changes made inside are discarded.
    ``modifier_rank`` is a rank within each parameter's replica group (as DeepSpeed's): the
    data-parallel group, or for MoE experts their expert-data-parallel group, so each group of
    experts takes the values of its own first rank with ``modifier_rank=0``."""

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter],
                 modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        self.params: list[PartitionedParam] = cast(
            "list[PartitionedParam]",
            [params] if isinstance(params, torch.Tensor) else list(params))
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[Any, Any]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for p in self.params:
            if is_partitioned(p):
                p.data = gather_partitioned(p)
        by_store: dict[int, tuple[Any, list[nn.Parameter]]] = {}
        for p in self.params:
            store = getattr(p, "mz_stage3_store", None)
            if store is not None:
                by_store.setdefault(id(store), (store, []))[1].append(p)
        for store, ps in by_store.values():
            self._units.append((store, store.gather_params(ps)))
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None
        if modify and dist.is_available() and dist.is_initialized():
            for p in self.params:
                group = _replica_group(p)
                assert self.modifier_rank is not None
                src = self.modifier_rank if group is None else dist.get_global_rank(
                    group, self.modifier_rank)
                dist.broadcast(p.data, src=src, group=group)
        for p in self.params:
            if is_partitioned(p):
                if modify:
                    _, rank = _group_info(p.mz_group)
                    per = p.mz_shard.numel()
                    flat = p.data.reshape(-1)
                    lo, hi = min(flat.numel(), rank * per), min(flat.numel(), (rank + 1) * per)
                    p.mz_shard[:hi - lo].copy_(flat[lo:hi])
                p.data = torch.empty(0, dtype=p.mz_shard.dtype, device=p.data.device)
        for store, held in self._units:
            store.release_params(held, write_back=modify)
        self._units = []
        if modify:
            engines = {id(e): e for p in self.params
                       if (e := getattr(p, "mz_engine", None)) is not None}
            for e in engines.values():
                e.sync_masters_from_model()
