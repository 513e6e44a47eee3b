"""Run a function on N local ranks (gloo on CPU) and collect every rank's result.

Each rank is a separate process started through a ``forkserver`` that has already imported
torch, so a world of 8 starts in about a second instead of re-importing torch 8 times (the slow
part on a 2-core machine). Ranks rendezvous through a ``FileStore`` in a fresh temporary
directory (no ports to collide on), run with one intra-op thread each, and report back through a
queue. The first failure is re-raised with its rank and traceback; a world that does not finish
within the timeout is killed, every process of it, and the test fails with a clear message.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX: Any = None


class DistributedTestError(RuntimeError):
    """A rank failed, died, or the world did not finish in time."""


_PRELOAD = ["torch", "torch.distributed", "megazero.testing.distributed",
            "megazero.testing.nccl_rules"]


def preload(*modules: str) -> None:
    """Have rank processes start with ``modules`` already imported (a slow import such as
    ``transformers`` is then paid once, by the forkserver, not by every rank of every world).
    Takes effect only before the first world of this process starts."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    if _CTX is None:
        return
    _CTX.set_forkserver_preload(list(_PRELOAD))


def _context():
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        _CTX = ctx
    return _CTX


def _rank_main(fn, rank, world_size, store_path, args, kwargs, results, backend, threads,
               rules=None):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        if rules is not None:
            from megazero.testing import nccl_rules

            nccl_rules.install(rank, *rules)
        # plain pickle: torch's queue pickler would send a tensor as a shared-memory file
        # descriptor, which is lost when this process exits before the parent receives it
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs),
                                              protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        # Reported first, torn down second: a teardown that waits on peers (a failed rank's,
        # or an older torch's gloo teardown waiting on pending work) cannot hide the result;
        # the parent ends every process once all results are in. No barrier: a failed rank
        # must not wait for ranks that will never arrive.
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    nccl_rules: bool | None = None,
    nccl_wait_limit: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results.

    ``fn`` must be importable (a module-level function) and its result picklable. Raises
    :class:`DistributedTestError` naming the first rank that failed (with its traceback), a
    rank that died without reporting, or the timeout; in every case no process is left behind.

    ``nccl_rules`` (default: the ``MEGAZERO_NCCL_RULES`` environment variable) runs the ranks
    under :mod:`megazero.testing.nccl_rules`: a collective given a host-resident tensor, or
    blocked longer than ``nccl_wait_limit`` seconds, fails its rank, and after the run the
    ranks' logs of collectives must agree group by group (a divergence is reported also when
    the world failed or hung, since it is usually the cause).
    """
    from megazero.testing import nccl_rules as rules_mod

    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="megazero-dist-")
    rules = ((tmp, rules_mod.wait_limit(nccl_wait_limit))
             if rules_mod.requested(nccl_rules) else None)
    results = ctx.Queue()
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, os.path.join(tmp, "store"), args, kwargs, results,
                      backend, threads_per_rank, rules),
                daemon=True,
            )
            p.start()
            procs.append(p)
        name = getattr(fn, "__name__", str(fn))
        logs = rules_mod.LogReader(tmp, world_size) if rules else None
        try:
            out = _collect(procs, results, world_size, timeout, name, logs)
        except DistributedTestError as exc:
            diverged = logs and logs.divergence()
            if diverged and "NCCL rules" not in str(exc):
                raise DistributedTestError(f"{exc}\nNCCL rules: {diverged}") from None
            raise
        diverged = logs and logs.divergence()
        if diverged:
            raise DistributedTestError(f"{name}: NCCL rules: {diverged}")
        return out
    finally:
        _kill(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs, results, world_size, timeout, name, logs=None) -> list[Any]:
    """Every rank's result; ``logs`` (a :class:`~megazero.testing.nccl_rules.LogReader`), when
    given, is checked once a second while the world runs, so that ranks whose collectives
    diverged fail now rather than hang until the timeout."""
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + 1.0
    while len(outputs) < world_size:
        if logs is not None and time.monotonic() >= next_check:
            next_check = time.monotonic() + 1.0
            diverged = logs.divergence(finished=False)
            if diverged:
                raise DistributedTestError(f"{name}: NCCL rules: {diverged} (seen while the "
                                           "world ran; all processes were killed)")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise DistributedTestError(
                f"{name}: world of {world_size} did not finish within {timeout:.0f}s; ranks "
                f"{missing} still running (a hang, or a collective some rank never joined). "
                f"All processes were killed."
            )
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in outputs and p.exitcode is not None]
            if dead:
                # Give the queue a moment: a rank may have reported just before exiting.
                try:
                    rank, ok, payload = results.get(timeout=1.0)
                except queue.Empty:
                    r = dead[0]
                    raise DistributedTestError(
                        f"{name}: rank {r} of {world_size} died with exit code "
                        f"{procs[r].exitcode} without reporting a result"
                    ) from None
            else:
                continue
        if not ok:
            dead = _died_silently(procs, {*outputs, rank})
            if dead is not None:  # the cause; the failure reported is its consequence
                raise DistributedTestError(
                    f"{name}: rank {dead} of {world_size} died with exit code "
                    f"{procs[dead].exitcode} without reporting a result; rank {rank} failed "
                    f"after it:\n{payload}")
            raise DistributedTestError(f"{name}: rank {rank} of {world_size} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return [outputs[r] for r in range(world_size)]


def _died_silently(procs, reported: set[int], grace: float = 1.0) -> int | None:
    """A rank, other than ``reported``, that exited with a non-zero code, waiting up to
    ``grace`` seconds for one. A rank that dies closes its connections, and a peer then fails
    in whatever it was doing (even ``init_process_group``, "Connection closed by peer"); the
    peer's report can arrive before the death is seen, but the death is what to report."""
    deadline = time.monotonic() + grace
    while True:
        dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode]
        if dead or time.monotonic() >= deadline:
            return dead[0] if dead else None
        time.sleep(0.05)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
