"""fp32 master weights for this rank's shard and the stock torch optimizer that updates them.

The shard is described as *pieces*: one contiguous 1-D range of one parameter that this rank
owns (a bucket shard can cut a parameter anywhere). Each piece has a view of the model's storage
(model dtype), a view of its reduced gradient and an fp32 master tensor. In fp32 training without
offload the master *is* the model view (no copy: updates land directly in the flat parameter
buffer); otherwise masters are views of one flat fp32 buffer, on the host when the optimizer is
offloaded.

The stock optimizer comes from the caller's factory (:mod:`megazero.zero.optimizers`) and sees
only the masters, grouped as the caller's param groups (by default: weight decay for matrices,
none for biases and norm weights, ``ndim < 2``). The step runs over
*sub-groups* of at most ``sub_group_size`` elements: only one sub-group's fp32 gradients exist at
a time, which bounds the temporary memory of casting and (with offload) of the device-to-host
copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megazero.config import ConfigError, OptimizerConfig
from megazero.distributed.host_resident import host_empty, mark, tracking
from megazero.optim.whole_norms import WholeParamNorms
from megazero.zero.host_step import copy_to_host, host_threads, step_threads
from megazero.zero.optimizers import (
    OptimizerFactory,
    OptimizerKind,
    config_factory,
    decay_groups,
    kind_of,
)
from megazero.zero.pieces import Piece, model_values, split_pieces, store_model

if TYPE_CHECKING:
    from megazero.zero.swap import OptimizerSwapper


def master_groups(pieces: list[Piece], groups: list[dict[str, Any]] | None,
                  decoupled: bool = False) -> list[dict[str, Any]]:
    """The torch param groups over the pieces' masters: each of ``groups`` (dicts of model
    parameters and settings) with its parameters' pieces; None: :func:`decay_groups` (with
    ``decoupled``, the embedding and output layer in a group of their own)."""
    if groups is None:
        params = list({id(p.param): p.param for p in pieces}.values())
        groups = decay_groups(params, {id(p.param): p.ndim for p in pieces}, decoupled)
    index = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    masters: list[list[torch.Tensor]] = [[] for _ in groups]
    for pc in pieces:
        if id(pc.param) not in index:
            raise ConfigError(f"the optimizer's param groups omit a trainable parameter of "
                              f"shape {tuple(pc.param.shape)}; list every parameter the model "
                              "trains (or set requires_grad=False on frozen ones)")
        assert pc.master is not None
        masters[index[id(pc.param)]].append(pc.master)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": m}
            for g, m in zip(groups, masters)]


class MasterParams:
    """Masters + optimizer for the pieces this rank owns."""

    def __init__(self, pieces: list[Piece], cfg: OptimizerConfig, *, offload: bool,
                 pin_memory: bool, sub_group_size: int,
                 swapper: Callable[[list[int]], OptimizerSwapper] | None = None,
                 factory: OptimizerFactory | None = None,
                 groups: list[dict[str, Any]] | None = None) -> None:
        """``factory`` builds the torch optimizer from param groups (default: from ``cfg``);
        ``groups`` are the caller's groups of model parameters (default: decay groups)."""
        self.pieces = split_pieces([p for p in pieces if p.model.numel()], sub_group_size)
        self.offload = offload
        dtypes = {p.model.dtype for p in self.pieces}
        self.copy = offload or dtypes != {torch.float32} or any(
            p.swapped is not None for p in self.pieces)
        self.flat: torch.Tensor | None = None
        self.swap: OptimizerSwapper | None = None
        self._resident = False
        self.pin_memory = pin_memory
        self._grad_stage: torch.Tensor | None = None  # see _staged
        # Lamb's whole-parameter norms: (owner params, per-piece sums) -> whole sums. None:
        # each parameter's pieces are all here (megazero.optim.whole_norms; set by the build)
        self.norm_reduce: Callable[[list[nn.Parameter], torch.Tensor], torch.Tensor] | None = None
        total = sum(p.model.numel() for p in self.pieces)
        if swapper is not None:
            # Masters are placeholders; the step points them at a slot of the swapper.
            for p in self.pieces:
                p.master = torch.empty(0, dtype=torch.float32)
        elif self.copy:
            device = self.pieces[0].model.device if self.pieces else torch.device("cpu")
            self.flat = (host_empty(total, torch.float32, pin_memory) if offload
                         else torch.empty(total, dtype=torch.float32, device=device))
            pos = 0
            for p in self.pieces:
                n = p.model.numel()
                p.master = self.flat[pos:pos + n]
                p.master.copy_(model_values(p))
                pos += n
        else:
            for p in self.pieces:
                p.master = p.model
        make = factory if factory is not None else config_factory(cfg)
        self.optimizer = make(master_groups(self.pieces, groups, cfg.decoupled_lr is not None))
        self.kind: OptimizerKind = kind_of(self.optimizer)
        self.sub_groups: list[list[Piece]] = []
        size = sub_group_size
        for p in self.pieces:
            if not self.sub_groups or size + p.model.numel() > sub_group_size:
                self.sub_groups.append([])
                size = 0
            self.sub_groups[-1].append(p)
            size += p.model.numel()
        if swapper is not None:
            self._init_swap(swapper)

    # --- NVMe: masters and moments in swap files ------------------------------------------

    def _init_swap(self, make: Callable[[list[int]], OptimizerSwapper]) -> None:
        if self.kind.whole_norms:
            raise ConfigError(f"zero_optimization.offload_optimizer.device \"nvme\" streams "
                              f"one sub-group at a time; {self.kind.name} needs every "
                              "parameter's norm before any update: use device \"cpu\"")
        if self.kind.state != ("exp_avg", "exp_avg_sq"):
            raise ConfigError(f"zero_optimization.offload_optimizer.device \"nvme\" swaps Adam's "
                              f"state (master, exp_avg, exp_avg_sq); {self.kind.name} keeps "
                              f"{', '.join(self.kind.state)}: use device \"cpu\" or \"none\" "
                              "with it, or Adam / AdamW")
        self.swap = make([sum(p.model.numel() for p in g) for g in self.sub_groups])
        for p in self.pieces:  # what torch's AdamW creates on its first step, minus storage
            self.optimizer.state[p.master] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}

        def init(g: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
            pos = 0
            for p in self.sub_groups[g]:
                n = p.model.numel()
                master[pos:pos + n].copy_(model_values(p))
                pos += n
            m.zero_()
            v.zero_()

        self.swap.stream(init, read=False)

    def _bind(self, g: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Point sub-group g's masters and moments at ``master`` / ``m`` / ``v`` (views)."""
        pos = 0
        for p in self.sub_groups[g]:
            n = p.model.numel()
            p.master.data = master[pos:pos + n]
            st = self.optimizer.state[p.master]
            st["exp_avg"], st["exp_avg_sq"] = m[pos:pos + n], v[pos:pos + n]
            pos += n

    def _collect(self, g: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """The inverse of :meth:`_bind`: copy whatever tensors the masters and state hold now
        (a loader may have replaced them) into the views, and drop the references."""
        pos = 0
        for p in self.sub_groups[g]:
            n = p.model.numel()
            st = self.optimizer.state.setdefault(p.master, {})
            for dst, src in ((master, p.master), (m, st.get("exp_avg")),
                             (v, st.get("exp_avg_sq"))):
                if src is not None and src.numel():
                    if src.data_ptr() != dst[pos:pos + n].data_ptr():
                        dst[pos:pos + n].copy_(src.reshape(-1))
                elif src is None or not src.numel():
                    dst[pos:pos + n].zero_()
            p.master.data = torch.empty(0, dtype=torch.float32)
            st["exp_avg"], st["exp_avg_sq"] = torch.empty(0), torch.empty(0)
            st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            pos += n

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Inside, every master and moment is an ordinary host tensor (read whole from the swap
        files, written back on exit): for checkpoints and loading, not for the step."""
        if self.swap is None or self._resident:
            yield
            return
        self._resident = True
        bufs = self.swap.load_all()
        for g, buf in enumerate(bufs):
            n = self.swap.numels[g]
            self._bind(g, buf[0, :n], buf[1, :n], buf[2, :n])
        try:
            yield
        finally:
            for g, buf in enumerate(bufs):
                n = self.swap.numels[g]
                self._collect(g, buf[0, :n], buf[1, :n], buf[2, :n])
            self.swap.store_all(bufs)
            self._resident = False

    def stream_states(self, fn: Callable[[Piece, dict[str, torch.Tensor | None]], None]) -> None:
        """Call ``fn(piece, {"master": t, <state name>: t or None})`` for every piece, with the
        tensors where they live: the masters and moments themselves (device or host), or with
        NVMe offload views of the swap slot its sub-group was read into (read only: nothing is
        written back). A state the optimizer has not created yet (before the first step) is
        None. ``fn`` must copy what it keeps. The checkpoint writer's mirror of
        :meth:`resident`: no more host memory than the swapper's own slots."""
        names = self.kind.state
        if self.swap is None or self._resident:
            for p in self.pieces:
                st = self.optimizer.state.get(p.master, {})
                fn(p, {"master": p.master, **{n: st.get(n) for n in names}})
            return

        def visit(g: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
            pos = 0
            for p in self.sub_groups[g]:
                n = p.model.numel()
                fn(p, {"master": master[pos:pos + n], "exp_avg": m[pos:pos + n],
                       "exp_avg_sq": v[pos:pos + n]})
                pos += n

        self.swap.stream(visit, read=True, write=False)

    def step(self, factor: float) -> None:
        """One optimizer step with every gradient multiplied by ``factor`` (unscale * clip).
        Offloaded, the host update runs on this rank's share of the node's cores
        (:mod:`megazero.zero.host_step`)."""
        if not self.offload:
            self._step(factor)
            return
        with host_threads(step_threads()):
            self._step(factor)

    def _step(self, factor: float) -> None:
        if self.kind.whole_norms:  # Lamb: two phases around one norm reduction
            self._step_whole_norms(factor)
            return
        if self.swap is not None:
            def update(g: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
                self._bind(g, master, m, v)
                self._step_group(self.sub_groups[g], factor)
                self._collect(g, master, m, v)

            self.swap.stream(update)
            return
        for group in self.sub_groups:
            self._step_group(group, factor)

    def _step_whole_norms(self, factor: float) -> None:
        """Lamb's step over this rank's masters (:mod:`megazero.optim.lamb`): every sub-group stages
        its gradients (times ``factor``: unscale x clip), updates its moments and sums its pieces'
        squares; one reduction (``self.norm_reduce``, else the pieces here are summed per
        parameter) gives the whole-parameter sums; then every sub-group applies its update and
        writes the model's copy. Only one sub-group's gradients are staged at a time, as Adam's.
        The sums of each whole parameter come from :mod:`megazero.optim.whole_norms`."""
        opt: Any = self.optimizer
        sums: list[torch.Tensor] = []
        for group in self.sub_groups:
            grads = self._staged(group) if self.copy else [p.grad for p in group]
            if factor != 1.0:
                torch._foreach_mul_(grads, factor)
            for p, g in zip(group, grads):
                p.master.grad = g
            sums.append(opt.partial_sums([p.master for p in group]))
            for p in group:
                p.master.grad = None
        owners = [p.param for g in self.sub_groups for p in g]
        local = torch.cat(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)
        reduce = self.norm_reduce or WholeParamNorms(
            list({id(p): p for p in owners}.values()), None, None, 0, torch.device("cpu"))
        whole = reduce(owners, local)
        pos = 0
        for group in self.sub_groups:
            ts = [p.master for p in group]
            opt.apply(ts, opt.coefficients(ts, whole[pos:pos + len(group)]))
            pos += len(group)
            for p in group:
                if self.offload and tracking():  # moments created beside host masters
                    for t in opt.state.get(p.master, {}).values():
                        if isinstance(t, torch.Tensor):
                            mark(t)
                if self.copy:
                    store_model(p, p.master, non_blocking=True)

    def _staged(self, group: list[Piece]) -> list[torch.Tensor]:
        """fp32 copies of the group's gradients on the masters' device. On the host they land
        in one buffer of the largest sub-group's size, allocated at the first step and reused:
        a fresh host tensor per sub-group would be a new mmap of that size each time, whose
        page faults cost more than the copy itself (and than the fused update). On an
        accelerator the caching allocator already reuses memory: a transient copy, no buffer
        kept between steps."""
        device = group[0].master.device
        if device.type != "cpu":
            return [p.grad.to(device=device, dtype=torch.float32, copy=True) for p in group]
        if self._grad_stage is None:
            width = max(sum(p.model.numel() for p in g) for g in self.sub_groups)
            self._grad_stage = host_empty(width, torch.float32, self.pin_memory)
        # pinned: non-blocking device-to-host copies, one synchronisation for the sub-group
        return copy_to_host([p.grad for p in group], self._grad_stage)

    def _step_group(self, group: list[Piece], factor: float) -> None:
        grads = self._staged(group) if self.copy else [p.grad for p in group]
        if factor != 1.0:
            torch._foreach_mul_(grads, factor)
        for p, g in zip(group, grads):
            p.master.grad = g
        self.optimizer.step()
        if self.offload and tracking():
            # The optimizer creates its moments beside the offloaded masters, on the host.
            for p in group:
                for t in self.optimizer.state.get(p.master, {}).values():
                    if isinstance(t, torch.Tensor):
                        mark(t)
        for p in group:
            p.master.grad = None
            if self.copy:
                # A swapped master's slot is reused right after: copy synchronously then.
                store_model(p, p.master, non_blocking=self.swap is None)

    def sync_masters_from_model(self) -> None:
        """After model weights were loaded from outside (a checkpoint without optimizer state)."""
        if self.copy:
            with self.resident():
                for p in self.pieces:
                    p.master.copy_(model_values(p))

    def sync_model_from_masters(self) -> None:
        if self.copy:
            with self.resident():
                for p in self.pieces:
                    store_model(p, p.master)

    def held(self) -> list[torch.Tensor]:
        """Optimizer-state storage: separate masters (if any) and moments (with NVMe offload:
        the host slots they stream through)."""
        if self.swap is not None:
            return list(self.swap.slots)
        out: list[torch.Tensor] = [self.flat] if self.flat is not None else []
        for state in self.optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out

    def state_dict(self) -> dict[str, Any]:
        with self.resident():
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        if self.swap is not None:
            masters = (torch.cat([p.master.detach().reshape(-1) for p in self.pieces])
                       if self.pieces else torch.empty(0))
            return {"masters": masters, "optimizer": _cloned(self.optimizer.state_dict()),
                    "piece_numels": [p.model.numel() for p in self.pieces],
                    "optimizer_type": self.kind.name}
        masters = (self.flat.clone() if self.flat is not None
                   else torch.cat([p.master.detach().reshape(-1) for p in self.pieces])
                   if self.pieces else torch.empty(0))
        return {"masters": masters, "optimizer": self.optimizer.state_dict(),
                "piece_numels": [p.model.numel() for p in self.pieces],
                "optimizer_type": self.kind.name}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with self.resident():
            self._load_state_dict(sd)

    def _load_state_dict(self, sd: dict[str, Any]) -> None:
        numels = [p.model.numel() for p in self.pieces]
        if list(sd["piece_numels"]) != numels:
            raise ValueError("optimizer shard layout differs from this run's (different model, "
                             "parallel layout, ZeRO stage or bucket sizes); reshard first")
        saved = sd.get("optimizer_type", self.kind.name)
        if saved != self.kind.name:
            raise ConfigError(f"the optimizer state was saved by {saved}; this run's optimizer "
                              f"is {self.kind.name}: use {saved}, or start {self.kind.name} "
                              "from the weights alone (load without the optimizer state)")
        pos = 0
        for p, n in zip(self.pieces, numels):
            p.master.copy_(sd["masters"][pos:pos + n])
            pos += n
        # torch's load_state_dict takes every group setting from the saved groups, the update
        # kernel too; this run's kernel follows where its masters are (update_kernel), so
        # a checkpoint written with the other kernel must not switch it
        kernel = [{k: g.get(k) for k in ("fused", "foreach")}
                  for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(sd["optimizer"])
        for g, k in zip(self.optimizer.param_groups, kernel):
            g.update(k)
        self.sync_model_from_masters()


def _cloned(sd: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict whose tensors do not share the (transient) swap buffers."""
    state = {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
             for k, v in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}
