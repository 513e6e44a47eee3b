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


_PRELOAD = ["torch", "torch.distributed", "megazero.testing.distributed"]


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


def _rank_main(fn, rank, world_size, store_path, args, kwargs, results, backend, threads):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
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
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results.

    ``fn`` must be importable (a module-level function) and its result picklable. Raises
    :class:`DistributedTestError` naming the first rank that failed (with its traceback), a
    rank that died without reporting, or the timeout; in every case no process is left behind.
    """
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="megazero-dist-")
    results = ctx.Queue()
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, os.path.join(tmp, "store"), args, kwargs, results,
                      backend, threads_per_rank),
                daemon=True,
            )
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout, getattr(fn, "__name__", str(fn)))
    finally:
        _kill(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs, results, world_size, timeout, name) -> list[Any]:
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
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
            raise DistributedTestError(f"{name}: rank {rank} of {world_size} failed:\n{payload}")
        outputs[rank] = payload
    return [outputs[r] for r in range(world_size)]


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
