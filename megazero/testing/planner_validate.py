"""The planner's per-rank memory against real iterations of the same layout.

:func:`measure_layouts` runs inside a spawned world (one process per rank). For each layout
(command-line flags) it builds the model chunks and the ZeRO engine as ``pretrain_gpt.py``
does, runs ``iters`` training iterations (pipeline executor, gradient sync, optimizer step) and
returns, per rank, the measured and the predicted:

* **saved activation bytes**: the executor's activation meter (``peak_saved_bytes``
  of the last iteration: the peak, over the schedule, of the storages autograd holds for
  backward) against :func:`megazero.planner.activations.peak_saved_bytes` (the same schedule
  walked with the planner's per-layer bytes);
* **peak memory**: the most bytes of live tensor storage during the last iteration, against the
  planner's device total (:func:`megazero.planner.estimate.rank_memory`). On CUDA the measure
  is ``torch.cuda.max_memory_allocated()`` after a reset before the iteration. On CPU it is
  :class:`LiveStorageBytes`: a dispatch mode, entered before the model is built, that records
  every storage any operator returns and holds it by a weak reference, so a storage counts
  from its creation until whichever thread drops it last. It measures what is allocated,
  independently of the planner's items (weights, grads, optimizer states, buckets,
  activations, logits, p2p buffers alike). Not seen, on either device: buffers a collective
  library allocates for itself (gloo's flat staging copy of an all-gather's output; NCCL's
  channels), which the planner does not count either.

Known gaps (not within 10%): ZeRO-3 with partitioned units (a unit over
``stage3_param_persistence_threshold``): the gathered parameters stay alive from a unit's
forward to its backward (the executor's meter sees them among the saved tensors), about one
gathered copy of the chunk's parameters more than the planner counts (+22% peak on the
8-layer h=64 model with the threshold at 0; +15% on bench/estimator_vs_measured.py --memory).
A likely cause: ``RowParallelLinear`` calls ``F.linear`` under autograd, which saves a
transposed view of the weight; the view keeps the unit's gathered storage alive after the
engine releases the unit.

The torch profiler's ``profile_memory`` events were tried first and rejected: they are
recorded per thread, so storages that gloo's worker threads release (the tensors of finished
asynchronous collectives) are never seen freed and the count drifts up (+14% on ZeRO-1 at
dp 2, +20% with sequence parallelism, varying from run to run).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.distributed.shm_collectives import another_ranks_buffer


class CudaPeakBytes:
    """Peak bytes the CUDA caching allocator hands out in a marked window."""

    def __init__(self) -> None:
        self.peak: float | None = None

    def __enter__(self) -> CudaPeakBytes:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        self.peak = float(torch.cuda.max_memory_allocated())


class LiveStorageBytes(TorchDispatchMode):
    """Peak bytes of live tensor storage, from every tensor an operator returns.

    Each new storage is held by a weak reference (it does not keep the storage alive) with its
    size; a storage is live until that reference expires, whichever thread drops the last
    reference (gloo's worker threads release the tensors of finished collectives, which a
    thread-local profiler does not see). The live total is re-swept (expired references
    dropped) whenever it would set a new peak, so the peak is exact at every operator
    boundary. Storage gloo allocates inside a collective without an operator (its flat
    staging buffers) is not seen. Another rank's shared-memory buffer mapped here (the
    shared-memory collectives read and write them) is its owner's, not counted. Mark the
    span to read with :meth:`window`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[Any, int]] = {}
        self.live = 0
        self.peak = 0.0
        self._in_window = False

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.refs.items() if ref.expired()]
        for k in dead:
            self.live -= self.refs.pop(k)[1]

    def _add(self, t: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        if another_ranks_buffer(st):  # mapped here, held by its owner
            return
        ptr = st.data_ptr()
        old = self.refs.get(ptr)
        if old is not None:
            if not old[0].expired():
                return
            self.live -= old[1]
        self.refs[ptr] = (StorageWeakRef(st), st.nbytes())
        self.live += st.nbytes()
        if self._in_window and self.live > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and \
                    not isinstance(t, torch.nn.Parameter):
                self._add(t)
        return out

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self._sweep()
        self.peak = float(self.live)
        self._in_window = True
        try:
            yield
        finally:
            self._in_window = False
            self._sweep()


def measure_layouts(rank: int, world: int, layouts: list[list[str]], iters: int = 2,
                    track_memory: bool = True) -> list[dict[str, Any]]:
    """Run every layout (full flag lists) ``iters`` iterations on this rank; one row each."""
    from megazero.config import load_config
    from megazero.data.random_batches import random_lm_batches
    from megazero.distributed.topology import ParallelTopology
    from megazero.pipeline.activation_meter import ActivationMeter
    from megazero.pipeline.executor import forward_backward
    from megazero.planner.activations import core_attention_saves_scores, peak_saved_bytes
    from megazero.planner.estimate import FRAGMENTATION_ITEM, rank_memory
    from megazero.training.builders import build_model_and_optimizer

    if torch.distributed.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    rows = []
    for flags in layouts:
        gc.collect()
        cfg = load_config(flags, world)
        p, t = cfg.parallel, cfg.train
        topo = ParallelTopology.build(tp=p.tp, pp=p.pp, vpp=cfg.vpp)
        m = (t.global_batch_size or t.micro_batch_size * topo.dp_size) // (
            t.micro_batch_size * topo.dp_size)
        sp = p.sequence_parallel_active
        meter = ActivationMeter()
        tracker: Any = None
        if track_memory:
            tracker = LiveStorageBytes() if device.type == "cpu" else CudaPeakBytes()
        with tracker if tracker is not None else contextlib.nullcontext():
            chunks, engine = build_model_and_optimizer(cfg, topo, device)
            for it in range(iters):
                batches = random_lm_batches(m, cfg.model.vocab_size, t.micro_batch_size,
                                            cfg.model.seq_length, seed=it * 1000 + topo.dp_rank)
                batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
                last = it == iters - 1
                with tracker.window() if (tracker is not None and last) else \
                        contextlib.nullcontext():
                    forward_backward(
                        chunks, iter(batches), topo, m, cfg.model.seq_length,
                        t.micro_batch_size, cfg.model.hidden_size, sequence_parallel=sp,
                        dtype=cfg.precision.params_dtype, grad_sync=engine,
                        activation_meter=meter if last else None,
                        microbatch_group_size=p.microbatch_group_size_per_vp_stage)
                    engine.finish_grad_sync()
                    engine.step()
                    del batches
        cpu = device.type == "cpu"
        flash = not core_attention_saves_scores(cfg, cpu)
        plan = rank_memory(cfg, topo.pp_rank, m, flash=flash, device_is_cpu=cpu)
        rows.append(dict(
            flags=flags, rank=topo.rank, pp_rank=topo.pp_rank, tp_rank=topo.tp_rank,
            dp_rank=topo.dp_rank, microbatches=m,
            measured_saved=meter.peak_saved_bytes,
            predicted_saved=peak_saved_bytes(cfg, topo.pp_rank, m, flash=flash,
                                             sdpa_math=not flash and cpu),
            measured_peak=tracker.peak if tracker is not None else None,
            # the allocator's peak has no fragmentation in it: compare without the allowance
            predicted_peak=plan.device_total - plan.items.get(FRAGMENTATION_ITEM, 0.0),
            items=dict(plan.items), sync=dict(plan.sync), step=dict(plan.step),
            engine_device_total=engine.memory_report()["device_total"],
            ))
        del chunks, engine
    return rows
