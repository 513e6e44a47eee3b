"""The ZeRO engine: sharded fp32 masters around a stock torch optimizer, for stages 0-3.

Training step (every stage, every parallel layout)::

    engine.zero_grad()
    for i, micro_batch in enumerate(micro_batches):
        ctx = engine.no_sync() if i < len(micro_batches) - 1 else nullcontext()
        with ctx:
            engine.backward(model(micro_batch).mean())   # backward scales the loss for fp16
    engine.finish_grad_sync()   # wait for buckets; tp / embedding sums; deferred dp reduction
    result = engine.step()      # overflow check, global norm, clip, update, re-gather params

Gradient communication lives in the buffers (stages 0-2, :mod:`megazero.zero.buffers`) or the
stage-3 parameter manager (:mod:`megazero.zero.stage3`); this class only sequences them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megazero.config import PrecisionConfig, ZeroConfig
from megazero.distributed.group_comm import CommLog, GroupComm
from megazero.distributed.topology import ParallelTopology
from megazero.tensor_parallel.utils import is_duplicate_copy
from megazero.zero import clip_grads
from megazero.zero.accounting import MemoryReport, StorageCounter
from megazero.zero.buffers import GradBuffer
from megazero.zero.loss_scaler import LossScaler
from megazero.zero.master import MasterParams
from megazero.zero.optimizers import place_step
from megazero.zero.param_store import ParamStore
from megazero.zero.pieces import Piece


@dataclass
class StepResult:
    updated: bool
    grad_norm: float
    loss_scale: float
    skipped: bool
    nonfinite: bool = False  # NaN/inf loss or (fp32/bf16) gradients; see ZeroOptimizer.step
    sums: tuple[float, ...] = ()  # the caller's ``also_sum`` values, summed over every rank
    num_zeros: float | None = None  # zero gradient elements of the model (count_zeros_in_grad)


@dataclass
class Comms:
    """Every group the engine talks to, sharing one :class:`CommLog`."""

    log: CommLog
    dp: GroupComm
    tp: GroupComm
    mp: GroupComm
    emb: GroupComm
    world: GroupComm

    @classmethod
    def from_topology(cls, topo: ParallelTopology, rs_impl: str = "auto",
                      shared_memory: str = "auto") -> Comms:
        log = CommLog()
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        emb = topo.embedding_group if topo.pp_size > 1 and topo.in_embedding_group else None
        # Gradients are reduced, and ZeRO shards, over the ranks that hold the same weights:
        # the data replicas, times the context-parallel ranks (grad_group is dp at cp = 1).
        return cls(log, GroupComm(topo.grad_group, "dp", log, rs_impl, shared_memory),
                   GroupComm(topo.tp_group, "tp", log), GroupComm(topo.mp_group, "mp", log),
                   GroupComm(emb, "embedding", log), GroupComm(world, "world", log))

    def set_timers(self, timers: Any) -> None:
        """Charge every collective's issue and wait to ``timers`` (``wall_clock_breakdown``)."""
        for g in (self.dp, self.tp, self.mp, self.emb, self.world):
            g.timers = timers


def _weakly(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """``method`` as a gradient hook that does not keep its object alive.

    A hook is stored in the parameter's hook table, so a bound method there makes a cycle
    (parameter -> optimizer -> parameter) that Python's collector cannot see through the
    tensor. The engine, its model and its process groups would then live until interpreter
    exit, and a gloo worker thread that drops its last work item during finalization (and
    with it a tensor's Python object) aborts the process ("terminate called without an
    active exception")."""
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


class ZeroOptimizer:
    """See the module docstring; build it with :func:`megazero.zero.build_zero_optimizer`.

    A :class:`megazero.pipeline.grad_sync.GradSync` at every stage: the pipeline executor and the
    training loop drive its ``no_sync`` / ``start_grad_sync`` / ``finish_grad_sync``; stage 0
    (plain all-reduce, no sharding) is how a run without ZeRO synchronises gradients.
    """

    #: Count the gradient's zero elements in each step (Megatron's --log-num-zeros-in-grad).
    count_zeros_in_grad: bool = False

    def __init__(self, stores: list[ParamStore], masters: MasterParams, comms: Comms,
                 topo: ParallelTopology,
                 zero: ZeroConfig, precision: PrecisionConfig, clip_grad: float,
                 sequence_parallel: bool) -> None:
        self.stores = stores
        self.masters = masters
        self.comms = comms
        self.topo = topo
        self.zero = zero
        self.precision = precision
        self.clip_grad = clip_grad
        self.sequence_parallel = sequence_parallel
        self.scaler = LossScaler.from_config(precision)
        # Scalars (overflow flag, squared norm) are reduced on the model's device: NCCL
        # refuses CPU tensors, and offloaded gradients live on the host.
        self.device = next((p.device for s in stores for p in s.params()), torch.device("cpu"))
        self._sync = True
        self._synced = False
        self._saw_sync_backward = False
        self._last_comm: dict[str, Any] = comms.log.report()
        self._hooks: list[Any] = []
        self._param_store: dict[int, ParamStore] = {}
        for store in stores:
            for p in store.params():
                self._param_store[id(p)] = store
                # torch's stub leaves this method unannotated
                hook = p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    _weakly(self._on_grad))
                self._hooks.append(hook)

    # --- the training-loop surface ------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.masters.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.precision.fp16 else loss

    def backward(self, loss: torch.Tensor) -> None:
        torch.autograd.backward(self.scale_loss(loss))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for store in self.stores:
            store.zero_grad()
        self._synced = False
        self._saw_sync_backward = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally at stages 0-1 (reduced once, after
        the last micro-batch); at stages 2-3 each micro-batch's gradients are reduced into the
        shards as their buckets fill, except the deferred ones (sequence-parallel and tied
        embedding parameters), which wait for the last (see the buffers' docstrings)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _on_grad(self, param: nn.Parameter) -> None:
        store = self._param_store[id(param)]
        if self._sync:
            self._saw_sync_backward = True
            store.grad_ready(param)
        else:
            store.grad_accumulated(param)

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket still waiting (the pipeline executor calls this
        after its last backward); :meth:`finish_grad_sync` completes it."""
        if not self._synced:
            for store in self.stores:
                store.flush()

    def finish_grad_sync(self) -> None:
        """Complete this step's gradient reduction (see the module docstring for the order)."""
        if self._synced:
            return
        if not self.zero.ignore_unused_parameters and self._saw_sync_backward:
            unused = [p for s in self.stores for p in s.unused_params()]
            if unused:
                raise RuntimeError(
                    f"{len(unused)} parameters received no gradient (shapes "
                    f"{[tuple(p.shape) for p in unused[:5]]}) and "
                    f"zero_optimization.ignore_unused_parameters is false")
        for store in self.stores:
            store.flush()
        for store in self.stores:
            store.wait()
        for store in self.stores:
            store.absorb_deferred()
        if self.comms.tp.size > 1:  # "sp": SP params and the q/k norms (none: no collective)
            for store in self.stores:
                for t in store.deferred_grads("sp"):
                    self.comms.tp.all_reduce(t)
        emb = [t for store in self.stores for t in store.deferred_grads("emb")]
        if len(emb) == 2:
            # The V of ZBV and DualPipeV: the first and the last stage, hence both copies of
            # the tied embedding, are this rank's; the sum is local (the other end of the
            # embedding group holds neither and posts nothing).
            emb[0].add_(emb[1])
            emb[1].copy_(emb[0])
        elif self.comms.emb.size > 1:
            for t in emb:
                self.comms.emb.all_reduce(t)
        for store in self.stores:
            store.reduce_deferred()
        self._synced = True

    def _stage0_norm_parts(self, pieces: Sequence[Any], tp_rank: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0's squared norm and zero count: full gradients are identical on every
        replica, so dense ones count on the first rank of their dp x cp group only and MoE
        experts (replicated over their expert-data-parallel group) on edp rank 0 only. Another
        replica contributes 0, or NaN if its gradients are not finite."""
        sq = torch.zeros((), dtype=torch.float32)
        zeros = torch.zeros((), dtype=torch.float64)
        for expert in (False, True):
            grads = [p.grad for p in pieces if getattr(p.param, "expert", False) == expert
                     and not is_duplicate_copy(p.param, tp_rank)]
            if expert and not grads:
                continue
            first = (self.topo.edp_rank if expert else self.topo.grad_rank) == 0
            part = clip_grads.sum_of_squares(grads)
            sq = sq + (part if first else part * 0.0)
            if self.count_zeros_in_grad:
                count = clip_grads.count_zeros(grads)
                zeros = zeros + (count if first else count * 0)
        return sq, zeros

    def step(self, loss_is_finite: bool = True, skip_nonfinite: bool = False,
             also_sum: Sequence[float] = (), divide_grads_by: int | None = None) -> StepResult:
        """Clip and apply this step's gradients, unless a rank sees a non-finite value.

        fp16 always checks (a gradient overflow under the loss scale skips the step and lowers
        the scale). ``skip_nonfinite`` extends the check to fp32/bf16 (Megatron's
        ``--check-for-nan-in-loss-and-grad``): a NaN/inf gradient, or ``loss_is_finite=False``
        on any rank, skips the update on every rank, so a single bad batch cannot write NaN
        into the masters. The result's ``nonfinite`` says the loss or gradients were NaN/inf
        in a way the loss scale does not explain (any non-finite loss; fp32/bf16 gradients).

        ``also_sum``: the caller's own per-rank values (the training loop's loss sum and exit
        votes) to be summed over every rank in the step's one scalar all-reduce, so that an
        iteration makes a single blocking collective besides the gradient and parameter
        traffic; the result's ``sums`` holds them (float64). ``divide_grads_by``: the index of
        one of them (summed) that the reduced gradients are divided by before the norm, the
        clip and the update (Megatron's ``--calculate-per-token-loss``: the global batch's
        token count).
        """
        self.finish_grad_sync()
        self.wait_for_params()  # a step with no forward since the last one
        pieces = self.masters.pieces
        scale = self.scaler.scale if self.precision.fp16 else 1.0
        # One blocking collective per step: the squared gradient norm, the non-finite loss
        # flag and the caller's ``also_sum``, summed over every rank (float64: the loss sums
        # keep their precision whatever the number of ranks). A rank's norm part is its
        # shard's; at stage 0 every data-parallel replica holds the same full gradients, so
        # only replica 0 contributes its value (the others contribute their finiteness).
        # A NaN/inf gradient anywhere makes the sum non-finite: that is the overflow check
        # (as Megatron's --check-for-nan-in-loss-and-grad and DeepSpeed's fp16 check on the
        # norm), with no separate pass over the gradients.
        tp_rank = self.topo.tp_rank
        if self.zero.stage == 0:
            sq, zeros = self._stage0_norm_parts(pieces, tp_rank)
        else:
            owned = [p.grad for p in pieces if not is_duplicate_copy(p.param, tp_rank)]
            sq = clip_grads.sum_of_squares(owned)
            # Megatron's --log-num-zeros-in-grad: the same elements as the norm, counted once.
            zeros = (clip_grads.count_zeros(owned) if self.count_zeros_in_grad
                     else torch.zeros((), dtype=torch.float64))
        scalars = torch.cat([
            sq.reshape(1).to(self.device, torch.float64),
            zeros.reshape(1).to(self.device, torch.float64),
            torch.tensor([float(not loss_is_finite), *also_sum], dtype=torch.float64,
                         device=self.device)])
        self.comms.world.all_reduce(scalars, what="scalar")
        total_sq, num_zeros, bad_loss_count, *sums = scalars.tolist()
        counted = num_zeros if self.count_zeros_in_grad else None
        bad_grad, bad_loss = not math.isfinite(total_sq), bad_loss_count > 0
        if (self.precision.fp16 or skip_nonfinite) and (bad_grad or bad_loss):
            self._end_step()
            if self.precision.fp16:
                self.scaler.update(overflow=True)
            nonfinite = bad_loss or not self.precision.fp16
            return StepResult(False, float("nan"), scale, True, nonfinite, tuple(sums), counted)
        divisor = scale * (max(sums[divide_grads_by], 1.0) if divide_grads_by is not None
                           else 1.0)
        norm = math.sqrt(max(total_sq, 0.0)) / divisor
        coef = clip_grads.clip_coefficient(norm, self.clip_grad)
        self.masters.step(coef / divisor)
        chunk = max(1, self.zero.allgather_bucket_size // max(1, self.comms.dp.size))
        for store in self.stores:
            if self.zero.overlap_param_gather and isinstance(store, GradBuffer):
                # left in flight: the next forward waits per bucket (megazero.zero.param_gather)
                store.start_param_gather(chunk, not self.zero.allgather_partitions)
            else:
                store.after_step(chunk, not self.zero.allgather_partitions)
        self._end_step()
        self.scaler.update(overflow=False)
        return StepResult(True, norm, scale, False, sums=tuple(sums), num_zeros=counted)

    def wait_for_params(self) -> None:
        """Complete the parameters' all-gathers left in flight by the last step
        (``overlap_param_gather``): call before reading the parameters outside a forward."""
        for store in self.stores:
            if isinstance(store, GradBuffer):
                store.wait_param_gather()

    def _end_step(self) -> None:
        self._last_comm = self.comms.log.report()
        self.comms.log.reset()
        self.zero_grad()

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: fp32 masters, torch optimizer state, loss scaler, layout."""
        self.wait_for_params()
        return {"zero_stage": self.zero.stage, "dp_rank": self.topo.grad_rank,
                "dp_size": self.topo.grad_size, "master": self.masters.state_dict(),
                "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if (sd["zero_stage"], sd["dp_size"]) != (self.zero.stage, self.topo.grad_size):
            raise ValueError(f"checkpoint shard is for ZeRO stage {sd['zero_stage']} at dp "
                             f"{sd['dp_size']}; this run is stage {self.zero.stage} at dp "
                             f"{self.topo.grad_size}")
        self.wait_for_params()
        self.masters.load_state_dict(sd["master"])
        self.scaler.load_state_dict(sd["loss_scaler"])
        chunk = max(1, self.zero.allgather_bucket_size // max(1, self.comms.dp.size))
        for store in self.stores:
            store.after_step(chunk, not self.zero.allgather_partitions)

    def load_param_states(self, read: Callable[[nn.Parameter, str, int, torch.Tensor], Any],
                          step: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Set masters and optimizer state piece by piece: ``read(param, kind, lo, dest)`` copies
        elements ``[lo, lo + dest.numel())`` of the parameter's flattened (TP-shard) ``kind``
        (master, or a state name of the optimizer's kind: exp_avg, exp_avg_sq,
        momentum_buffer) into ``dest``; ``step(param)`` gives its step count (for optimizers
        that count steps).
        This is how a layout-independent checkpoint loads, whatever the buckets, dp size or ZeRO
        stage; each piece's range is read straight into the state that keeps it, so loading
        allocates no more than this rank's own moments."""
        self.wait_for_params()
        with self.masters.resident():
            self._load_param_states(read, step)
        chunk = max(1, self.zero.allgather_bucket_size // max(1, self.comms.dp.size))
        for store in self.stores:
            store.after_step(chunk, not self.zero.allgather_partitions)

    def _load_param_states(self, read: Callable[[nn.Parameter, str, int, torch.Tensor], Any],
                           step: Callable[[nn.Parameter], torch.Tensor]) -> None:
        opt, kind = self.masters.optimizer, self.masters.kind
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for pc in self.masters.pieces:
            lo, n = pc.offset, pc.model.numel()
            dev = pc.master.device
            read(pc.param, "master", lo, pc.master)
            state: dict[str, torch.Tensor] = {}
            if kind.has_step:
                state["step"] = place_step(step(pc.param), pc.master, group_of[id(pc.master)])
            for name in kind.state:
                state[name] = torch.empty(n, dtype=torch.float32, device=dev)
                read(pc.param, name, lo, state[name])
            opt.state[pc.master] = state
        self.masters.sync_model_from_masters()

    # --- accounting ---------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds for params, grads and optimizer state, by placement, counted
        from real tensor storage (:class:`megazero.zero.accounting.MemoryReport` as a dict:
        ``bytes[kind][place]``, ``device_total``, ``offload_total``, ``padding_elements``).

        The run-time side of the one cost model: ``--log-memory-phases``, the checkpoint size
        check before saving and the planner's validation read it, and tests compare it byte
        for byte with :mod:`megazero.planner.model_states`."""
        device = next(iter(self._all_params()), torch.empty(0)).device.type
        report = MemoryReport(device_type=device,
                              padding_elements=sum(s.padding for s in self.stores))
        counter = StorageCounter(report)
        for store in self.stores:
            for place, tensors in store.held_params().items():
                counter.add("params", tensors, place)
        for store in self.stores:
            counter.add("grads", store.held_grads())
        counter.add("optimizer", self.masters.held(),
                    "offload" if self.masters.offload else "device")
        return report.as_dict()

    def comm_report(self) -> dict[str, Any]:
        """Bytes each collective moved during the last completed step, by ``group/op``:
        ``logical_bytes`` (ring-collective bytes per rank, the ZeRO paper's traffic formulas),
        ``physical_bytes`` (what the operation actually issued moves) and ``calls``."""
        return self._last_comm

    def _all_params(self) -> Iterator[nn.Parameter]:
        for store in self.stores:
            yield from store.params()

    @contextmanager
    def gathered_parameters(self, write_back: bool = False) -> Iterator[None]:
        """Inside, every parameter holds its full (data-parallel) value: for saving a
        consolidated checkpoint or evaluating at stage 3. Collective over dp.

        ``write_back=True``: weights assigned inside (``model.load_state_dict``) are kept: the
        stage-3 shards and the fp32 masters are refreshed from them on exit.
        """
        self.wait_for_params()
        for store in self.stores:
            store.gather_all()
        try:
            yield
        finally:
            for store in self.stores:
                store.release_all(write_back)
            if write_back:
                self.sync_masters_from_model()

    def sync_masters_from_model(self) -> None:
        """Refresh the fp32 masters from the model's weights: call after loading weights into
        the model without the optimizer state (finetuning), or they would overwrite them."""
        self.masters.sync_masters_from_model()

    def full_parameters(self) -> dict[int, torch.Tensor]:
        """A full copy of every parameter keyed by ``id(param)`` (collective over dp at
        stage 3: every dp rank must call it); the stage-3 checkpoint writer saves these."""
        self.wait_for_params()
        out: dict[int, torch.Tensor] = {}
        for store in self.stores:
            out.update(store.gathered_state())
        return out

    def pieces(self) -> list[Piece]:
        return self.masters.pieces
