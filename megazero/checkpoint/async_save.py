"""Asynchronous saves (``--async-save``): training goes on while the files are written.

At a save step each rank does what a synchronous save does before its first write: it agrees
the optimizer's step count over dp and takes its small files (random states, rank 0's extra
state). Then two background threads, at a lower scheduling priority than training, take over:
a *producer* copies the ranges the rank owns from where they live into host buffers (pinned
where CUDA is available), a bucket file at a time, and a *writer* writes each file (temporary
name, fsync, rename, checksum) and frees it. The objects are the very ones a synchronous save
hands to ``torch.save``, so the files are byte-identical.

The producer reads the live weights and optimizer state while the next iteration's forward and
backward run: nothing changes them before the optimizer step. It keeps at most one file copied
ahead of the writer; before the next optimizer step the loop calls :meth:`AsyncSaver.freeze`,
and the producer copies whatever is left at once (the only time training waits). So the host
memory a save adds is the files not yet written when the step comes, at most the rank's state,
and less the longer an iteration is against the write. (With state on NVMe, whose swap buffers
training uses too, everything is copied at the save step.)

Agreement without a barrier at the save step. Once its writer is done, a rank posts its part
of the index (its ranges, its files' sizes and checksums, or why a write failed) in the job's
key-value store, and from then on votes "done" in the iteration's one scalar all-reduce, which
the training step makes anyway (:meth:`AsyncSaver.votes`). When every rank has voted done, all
ranks learn it after the same iteration (:meth:`AsyncSaver.settle`); rank 0 then reads the parts
and writes ``config.json``, ``metadata.json`` and the tracker, exactly as the synchronous save
does, and only then logs "saved checkpoint". Every rank keeps the same view of the save's fate.
A crash at any moment before leaves the previous checkpoint as ``latest``; the unfinished
directory carries the in-progress marker that start-up removes
(:func:`megazero.checkpoint.save_check.remove_failed_saves`).

* At most one save is in flight: the next save, an exit and the end of training wait for it
  (:meth:`AsyncSaver.wait`, collective, which says so in the log).
* A write that fails (a full disk, a permission) is one line from rank 0 naming the rank, the
  path and the cause; the directory is removed and the tracker stays. Whether training goes on
  is the caller's choice (``--exit-on-save-failure``).
* A save in flight when a spike is seen (:mod:`megazero.training.divergence`) is discarded once
  its writers are done (:meth:`AsyncSaver.discard`), never committed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megazero.checkpoint.files import Writer, mark_in_progress
from megazero.checkpoint.save import (
    RankSave,
    commit_save,
    prepare_save,
    rank_small_files,
    run_state,
    write_file,
    write_rank_ranges,
)
from megazero.checkpoint.save_check import explain_write_error
from megazero.checkpoint.save_ranges import DEFAULT_BUCKET_BYTES

#: niceness of the writer threads: the training threads keep the cores first
WRITER_NICENESS = 10
#: the entries :meth:`AsyncSaver.votes` adds to the iteration's all-reduce
VOTES = 3


def staged_bytes(obj: Any) -> int:
    """Host bytes held by the tensors inside ``obj`` (dicts and lists of tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(staged_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(staged_bytes(v) for v in obj)
    return 0


@dataclass
class InFlight:
    """One save between its save step and its settlement."""

    plan: RankSave
    topo: Any
    writer: Writer
    commit_args: dict[str, Any]
    saved_before: int | None  # the newest checkpoint before this one (None: none)
    started: float
    files: list[tuple[Any, str]] = field(default_factory=list)  # copied, not yet written
    cond: threading.Condition = field(default_factory=threading.Condition)
    frozen: bool = False  # the producer copies the rest at once (the step is waiting)
    produced: bool = False  # every file copied (or the producer failed)
    done: threading.Event = field(default_factory=threading.Event)
    held_bytes: int = 0  # host bytes of copied files not yet written
    peak_bytes: int = 0
    frozen_s: float = 0.0  # what the step waited for the producer
    written_s: float = 0.0
    posted: bool = False
    discard_why: str | None = None


@dataclass(frozen=True)
class Outcome:
    """How a save in flight ended, the same on every rank."""

    iteration: int
    committed: bool
    saved_before: int | None
    why: str = ""  # not committed: discarded or failed, and why
    discarded: bool = False  # not committed on purpose (a spike), not a failure


class _Abandoned(Exception):
    """The writer failed: the producer stops copying."""


def _swapped(engine: Any) -> bool:
    """Whether some of the engine's state lives on NVMe (read through swap buffers that the
    training step uses too)."""
    if engine is None:
        return False
    masters = engine.masters
    return getattr(masters, "swap", None) is not None or any(
        pc.swapped is not None for pc in masters.pieces)


def _lower_priority() -> None:
    """Run this thread behind the training threads (Linux: a thread has its own niceness)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):
        pass


class AsyncSaver:
    """The asynchronous saves of one run (see the module docstring).

    ``store``: the job's key-value store (``torch.distributed``'s default store); ``prefix``:
    a key prefix unique to this run attempt; ``log``: rank 0's log line writer (None on other
    ranks); ``device``: where the waiting all-reduce's tensor lives."""

    def __init__(self, rank: int, world_size: int, store: Any, prefix: str,
                 device: torch.device, log: Callable[[str], None] | None = None) -> None:
        self.rank, self.world_size, self.store, self.prefix = rank, world_size, store, prefix
        self.device = device
        self.log = log or (lambda _line: None)
        self.in_flight: InFlight | None = None
        self.peak_staged_bytes = 0
        self.last: Outcome | None = None  # the newest save that ended, as every rank sees it
        self.index_failed = False  # rank 0: the last commit's own writes failed, not yet told

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    # --- the save step ------------------------------------------------------------------

    def start(self, root: str, iteration: int, topo: Any, *, models: Sequence[torch.nn.Module],
              optimizer: Any, scheduler: Any, consumed_samples: int, config: Any,
              zero_stage: int = 0, rng_tracker: Any = None, run_id: str | None = None,
              writer: Writer | None = None, saved_before: int | None = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, extra_state: Any = None) -> None:
        """Begin a save of the state as it is now. Collective as far as the synchronous save is
        before its first write (the step count over dp); the caller has waited for a save in
        flight first (:meth:`wait`). ``extra_state`` as :func:`save_checkpoint`'s."""
        assert self.in_flight is None, "one asynchronous save at a time: wait() first"
        t0 = time.perf_counter()
        plan = prepare_save(root, iteration, topo, models=models, optimizer=optimizer,
                            rng_tracker=rng_tracker, bucket_bytes=bucket_bytes,
                            extra_state=extra_state)
        small: list[tuple[Any, str]] = []
        try:
            mark_in_progress(plan.directory, run_id)
            small = rank_small_files(plan)
        except (OSError, RuntimeError) as e:
            plan.problem = explain_write_error(root, iteration, e)
        # what the index records of the run's state, as it is now (training goes on)
        commit_args = {"config": config, "consumed_samples": consumed_samples,
                       "zero_stage": zero_stage, "run_id": run_id,
                       "state": copy.deepcopy(run_state(scheduler, plan.engine))}
        job = InFlight(plan, topo, writer if writer is not None else Writer(), commit_args,
                       saved_before, t0)
        self.in_flight = job
        threading.Thread(target=self._write, args=(job,), daemon=True,
                         name=f"megazero-save-{iteration}-writer").start()
        if _swapped(plan.engine):  # NVMe state: its swap buffers are training's too
            job.frozen = True
            self._produce(job, small)
        else:
            threading.Thread(target=self._produce, args=(job, small), daemon=True,
                             name=f"megazero-save-{iteration}-producer").start()

    def _produce(self, job: InFlight, small: list[tuple[Any, str]]) -> None:
        if threading.current_thread() is not threading.main_thread():
            _lower_priority()

        def put(obj: Any, rel: str) -> None:
            nbytes = staged_bytes(obj)
            with job.cond:
                if job.plan.problem is not None:  # the writer failed: nothing more to copy
                    raise _Abandoned
                job.files.append((obj, rel))
                job.held_bytes += nbytes
                job.peak_bytes = max(job.peak_bytes, job.held_bytes)
                job.cond.notify_all()
                # one file copied ahead of the writer, until the step needs the state
                while len(job.files) > 1 and not job.frozen and job.plan.problem is None:
                    job.cond.wait()

        try:
            if job.plan.problem is None:
                write_rank_ranges(job.plan, put)
                for obj, rel in small:
                    put(obj, rel)
        except _Abandoned:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by rank 0, never lost
            job.plan.problem = explain_write_error(job.plan.root, job.plan.iteration, e)
        finally:
            with job.cond:
                job.produced = True
                job.cond.notify_all()

    def _write(self, job: InFlight) -> None:
        _lower_priority()
        t0 = time.perf_counter()
        try:
            while True:
                with job.cond:
                    while not job.files and not job.produced:
                        job.cond.wait()
                    if not job.files:
                        break
                    obj, rel = job.files[0]
                if job.plan.problem is None:
                    write_file(job.writer, job.plan, obj, rel)
                with job.cond:
                    job.files.pop(0)
                    job.held_bytes -= staged_bytes(obj)
                    job.cond.notify_all()
                del obj
        except BaseException as e:  # noqa: BLE001 - reported by rank 0, never lost
            job.plan.problem = explain_write_error(job.plan.root, job.plan.iteration, e)
            with job.cond:
                job.files.clear()
                job.cond.notify_all()
        finally:
            job.written_s = time.perf_counter() - t0
            self.peak_staged_bytes = max(self.peak_staged_bytes, job.peak_bytes)
            job.done.set()

    def freeze(self) -> None:
        """Before the optimizer changes the weights and its state: the producer copies every
        range it has not yet copied, now. Every rank calls it before each step; a no-op
        with nothing in flight or everything copied."""
        job = self.in_flight
        if job is None or job.produced:
            return
        t0 = time.perf_counter()
        with job.cond:
            job.frozen = True
            job.cond.notify_all()
            while not job.produced:
                job.cond.wait()
        job.frozen_s += time.perf_counter() - t0

    # --- every iteration ----------------------------------------------------------------

    def votes(self) -> list[float]:
        """``[writer done, writer failed, rank 0's index write failed]`` of this rank, for the
        iteration's all-reduce (:data:`VOTES` entries). A rank votes done only after its part
        is in the store; rank 0 tells, once, that the last commit it attempted failed."""
        told = float(self.index_failed)
        job = self.in_flight
        if job is None or not job.done.is_set():
            return [0.0, 0.0, told]
        self._post(job)
        return [1.0, float(job.plan.problem is not None), told]

    def discard(self, why: str) -> int | None:
        """A spike makes the weights of the save in flight suspect: it is removed once written,
        never committed (every rank calls it alike). Returns the newest checkpoint before it,
        which stays the latest."""
        job = self.in_flight
        assert job is not None, "nothing in flight to discard"
        if job.discard_why is None:
            job.discard_why = why
            self.log(f"the checkpoint of iteration {job.plan.iteration}, still being written, "
                     f"will be discarded: {why}")
        return job.saved_before

    def settle(self, summed: list[float]) -> list[Outcome]:
        """After the iteration's all-reduce, with the :meth:`votes` summed over every rank:
        the saves whose fate every rank learnt now, the same on every rank. A save in flight
        ends once every writer is done (rank 0 commits it, or removes it); a commit whose
        index rank 0 could not write is told one iteration later, as not committed."""
        out = []
        if summed[2] > 0 and self.last is not None and self.last.committed:
            self.index_failed = False
            self.last = Outcome(self.last.iteration, False, self.last.saved_before,
                                "rank 0 could not write its index")
            out.append(self.last)
        job = self.in_flight
        if job is not None and summed[0] >= self.world_size:
            out.append(self._end(job, failed=summed[1] > 0))
        return out

    def wait(self, why: str) -> list[Outcome]:
        """Collective: block until the save in flight is written everywhere and end it (and
        learn whether rank 0's last commit failed); ``why`` names what waits, for the log.
        Returns what :meth:`settle` returns."""
        job = self.in_flight
        t0 = time.perf_counter()
        self.freeze()  # nothing trains meanwhile: copy the rest at once
        if job is not None and not job.done.is_set():
            self.log(f"waiting for the checkpoint of iteration {job.plan.iteration} to be "
                     f"written before {why}")
            job.done.wait()
        flags = torch.tensor(self.votes(), dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(flags)  # every rank's writer is done after this
        out = self.settle(flags.tolist())
        waited = time.perf_counter() - t0
        if job is not None and waited > 0.5:
            self.log(f"waited {waited:.1f}s for the checkpoint of iteration "
                     f"{job.plan.iteration} before {why}")
        return out

    # --- internals ------------------------------------------------------------------------

    def _key(self, iteration: int, rank: int) -> str:
        return f"{self.prefix}/save/{iteration}/{rank}"

    def _post(self, job: InFlight) -> None:
        if not job.posted:
            self.store.set(self._key(job.plan.iteration, self.rank),
                           json.dumps(list(job.plan.result())))
            job.posted = True

    def _end(self, job: InFlight, failed: bool) -> Outcome:
        """Every rank: the save in flight is written everywhere. Rank 0 reads the parts and
        commits (or removes the directory); the outcome is decided from what every rank
        knows alike (the votes and the discard), so ranks never disagree about it."""
        self.in_flight = None
        self.last = self._settled(job, failed)
        return self.last

    def _settled(self, job: InFlight, failed: bool) -> Outcome:
        plan, it = job.plan, job.plan.iteration
        outcome = Outcome(it, True, job.saved_before)
        if job.discard_why is not None:
            outcome = Outcome(it, False, job.saved_before, job.discard_why, discarded=True)
        elif failed:
            outcome = Outcome(it, False, job.saved_before, "a rank's write failed")
        if self.rank != 0:
            return outcome
        gathered = []
        for r in range(self.world_size):
            key = self._key(it, r)
            gathered.append(json.loads(self.store.get(key)))
            self.store.delete_key(key)
        if not outcome.committed:
            shutil.rmtree(plan.directory, ignore_errors=True)  # marked: never a committed one
            bad = [(r, g[2]) for r, g in enumerate(gathered) if g[2]]
            if bad:
                more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
                self.log(f"error: the asynchronous save of iteration {it} failed on rank "
                         f"{bad[0][0]}{more}: {bad[0][1]}")
                return Outcome(it, False, job.saved_before, f"rank {bad[0][0]}: {bad[0][1]}")
            self.log(f"discarded the checkpoint of iteration {it} before it was committed: "
                     f"{job.discard_why}")
            return outcome
        problem = commit_save(job.writer, plan, gathered, job.topo, **job.commit_args)
        if problem is not None:  # rank 0's own index write: every rank learns it next
            self.index_failed = True
            self.log(f"error: the asynchronous save of iteration {it} failed on rank 0: "
                     f"{problem}")
            return outcome  # as the others see it, until settle() tells them
        self.log(f"saved checkpoint at iteration {it:7d} to {plan.root} (asynchronously: "
                 f"written in {job.written_s:.2f}s, committed "
                 f"{time.perf_counter() - job.started:.2f}s after the save step; at most "
                 f"{job.peak_bytes / 2**20:.1f} MiB held in host memory, training waited "
                 f"{job.frozen_s:.2f}s for copies)")
        return outcome
