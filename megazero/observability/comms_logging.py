"""The communication logger: DeepSpeed's ``"comms_logger"`` block.

While installed, every collective megazero issues through ``torch.distributed`` (ZeRO's bucket
reductions and gathers, tensor/sequence parallelism, pipeline and context-parallel
point-to-point, MoE all-to-all, barriers) is timed and counted per (operation, message size),
and so is what gloo groups on one host do in shared memory instead (``shm_all_reduce``,
``shm_reduce_scatter``, ``shm_all_gather``: :mod:`megazero.distributed.shm_collectives`).
``pretrain_gpt.py`` prints the summary at the end of training; the engine API's users call
:func:`log_summary` where they like (DeepSpeed's ``deepspeed.comm.log_summary()``)::

    "comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "debug": false}

``verbose`` prints each operation as it completes; ``prof_all: false`` with
``"prof_ops": ["all_reduce", ...]`` profiles only those; ``debug`` keys each record by the
function that issued it as well.

**Columns** are DeepSpeed's: message size, count, total and average latency (ms; the average is a
10% trimmed mean), algorithm and bus bandwidth (Gbps). **Bandwidths** follow nccl-tests'
PERFORMANCE.md: ``algbw = size / time`` and ``busbw = algbw * factor``, with factor
``2 (n - 1) / n`` for all-reduce, ``(n - 1) / n`` for all-gather, reduce-scatter and all-to-all,
and 1 for broadcast, reduce, gather, scatter and point-to-point, where ``n`` is the size of the
operation's own group (DeepSpeed divides by the world size whatever the group). **Message size**
is the whole buffer, as nccl-tests counts it: all-reduce and broadcast their tensor, all-gather
the gathered output, reduce-scatter the unreduced input, all-to-all the input, point-to-point
(``batch_isend_irecv``) the bytes this rank sends and receives.

**Timing serialises**, as DeepSpeed's does: a profiled operation synchronises the device before
and after, and an asynchronous one is waited for at once, so communication no longer overlaps
compute. The logger is a diagnostic; leave it off for speed.

Installing replaces the functions in the ``torch.distributed`` namespace (as DeepSpeed logs calls
made through ``torch.distributed``); :meth:`CommsLogger.uninstall` puts them back. The functions
in ``torch.distributed.distributed_c10d`` are left alone, so collectives torch issues inside its
own helpers (``all_gather_object``) are not counted, and ``P2POp`` keeps accepting ``dist.isend``.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megazero.config.observability_schema import (
    ALL_REDUCE,
    ONE,
    OPERATIONS,
    RING,
    CommsLoggerSettings,
)

SHARED_MEMORY_PREFIX = "shm_"

COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
           "tput_avg (Gbps)", "busbw_avg (Gbps)")
COLUMN_WIDTH = 20


def bandwidths(op: str, size_bytes: int, latency_ms: float, group_size: int
               ) -> tuple[float, float]:
    """(algbw, busbw) in Gbps for ``size_bytes`` moved by ``op`` in ``latency_ms`` over a group
    of ``group_size`` ranks (see the module docstring)."""
    if latency_ms <= 0:
        return 0.0, 0.0
    algbw = size_bytes * 8 / (latency_ms * 1e-3) / 1e9
    n = max(1, group_size)
    factor = {ALL_REDUCE: 2 * (n - 1) / n, RING: (n - 1) / n, ONE: 1.0}[OPERATIONS[op][1]]
    return algbw, algbw * factor


def human_size(size_bytes: int) -> str:
    """1024-based, two decimals: ``"2.0 KB"``, ``"678.86 MB"`` (DeepSpeed's column)."""
    if size_bytes <= 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(len(units) - 1, int(math.floor(math.log(size_bytes, 1024))))
    return f"{round(size_bytes / 1024 ** i, 2)} {units[i]}"


def trimmed_mean(values: list[float], fraction: float = 0.1) -> float:
    """The mean without the lowest and highest ``fraction`` of the values."""
    ordered = sorted(values)
    cut = int(len(ordered) * fraction)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dist.P2POp):
        yield value.tensor
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _group_size(op: str, arguments: Mapping[str, Any]) -> int:
    group = arguments.get("group")
    if op == "batch_isend_irecv":
        return 2  # point-to-point: the factor is 1 whatever the size
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


class WaitedWork:
    """A work handle the logger has already waited for: its ``wait`` returns at once. A gloo
    point-to-point handle must not be waited twice (the second wait blocks for a send or
    receive that never comes), so the caller gets this in its place."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _waited(result: Any) -> Any:
    """Wait for an asynchronous op's handle (or list of handles); return what the caller gets."""
    if hasattr(result, "wait"):
        result.wait()
        return WaitedWork(result)
    if isinstance(result, list):
        for work in result:
            work.wait()
        return [WaitedWork(work) for work in result]
    return result


def _synchronize(tensors: Iterable[torch.Tensor]) -> None:
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


@dataclass
class Record:
    """One (operation, message size): its latencies and bandwidths, one entry per call."""

    latencies_ms: list[float] = field(default_factory=list)
    algbw: list[float] = field(default_factory=list)
    busbw: list[float] = field(default_factory=list)


class CommsLogger:
    """Times ``torch.distributed`` collectives while installed; see the module docstring."""

    def __init__(self, settings: CommsLoggerSettings,
                 log: Callable[[str], object] | None = print) -> None:
        self.settings = settings
        self.log = log  # None on ranks that do not print
        self.records: dict[str, dict[int, Record]] = {}
        self._originals: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def profiles(self, op: str) -> bool:
        return self.settings.prof_all or op in self.settings.prof_ops

    def install(self) -> CommsLogger:
        """Replace ``torch.distributed``'s collectives with timed ones (idempotent). A logger
        installed before is uninstalled first: one process has one (the latest configuration,
        as DeepSpeed's global logger)."""
        global _active
        if self.installed:
            return self
        if _active is not None:
            _active.uninstall()
        for op in OPERATIONS:
            fn = getattr(dist, op, None)
            if fn is not None:
                self._originals[op] = fn
                setattr(dist, op, self._timed(op, fn))
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        for op, fn in self._originals.items():
            setattr(dist, op, fn)
        self._originals.clear()
        if _active is self:
            _active = None

    def _timed(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        message_arg = OPERATIONS[op][0]

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.profiles(op):
                return fn(*args, **kwargs)
            arguments = signature.bind(*args, **kwargs).arguments
            message = arguments.get(message_arg) if message_arg else None
            tensors = list(_tensors(message))
            _synchronize(tensors)
            start = time.perf_counter()
            result = _waited(fn(*args, **kwargs))
            _synchronize(tensors)
            latency_ms = (time.perf_counter() - start) * 1e3
            # batch_isend_irecv: what this rank sends and receives
            size = sum(t.numel() * t.element_size() for t in tensors)
            name = op
            if self.settings.debug:
                name = f"{op} | [Caller Func: {sys._getframe(1).f_code.co_name}]"
            self.record(op, name, size, latency_ms, _group_size(op, arguments))
            return result

        return timed

    def record(self, op: str, name: str, size_bytes: int, latency_ms: float,
               group_size: int) -> None:
        algbw, busbw = bandwidths(op, size_bytes, latency_ms, group_size)
        with self._lock:
            rec = self.records.setdefault(name, {}).setdefault(size_bytes, Record())
            rec.latencies_ms.append(latency_ms)
            rec.algbw.append(algbw)
            rec.busbw.append(busbw)
        if self.settings.verbose and self.log is not None:
            self.log(f"comm op: {name} | time (ms): {latency_ms:.2f} | msg size: "
                     f"{human_size(size_bytes)} | algbw (Gbps): {algbw:.2f} | "
                     f"busbw (Gbps): {busbw:.2f}")

    def rows(self) -> list[tuple[str, int, int, float, float, float, float]]:
        """(op, size, count, total ms, average ms, algbw, busbw) per record, sorted."""
        with self._lock:
            snapshot = {name: dict(sizes) for name, sizes in self.records.items()}
        return [(name, size, len(rec.latencies_ms), sum(rec.latencies_ms),
                 trimmed_mean(rec.latencies_ms), trimmed_mean(rec.algbw),
                 trimmed_mean(rec.busbw))
                for name in sorted(snapshot) for size, rec in sorted(snapshot[name].items())]

    def summary(self) -> str:
        """DeepSpeed's ``log_summary`` table: a line per operation, a row per message size."""
        w = COLUMN_WIDTH
        lines = ["".join(c.ljust(w) for c in COLUMNS).rstrip()]
        last = None
        for name, size, count, total, avg, algbw, busbw in self.rows():
            if name != last:
                lines.append(name)
                last = name
            lines.append((" " * w + human_size(size).ljust(w) + str(count).ljust(w)
                          + "".join(f"{v:.2f}".ljust(w) for v in (total, avg, algbw, busbw))
                          ).rstrip())
        return "\n".join(lines)

    def reset(self) -> None:
        with self._lock:
            self.records.clear()


_active: CommsLogger | None = None  # the installed logger, for log_summary()


def installed_logger() -> CommsLogger | None:
    return _active


def record_shared_memory(kind: str, size_bytes: int, latency_ms: float, group_size: int) -> None:
    """Count a shared-memory collective (``kind``: all_reduce, reduce_scatter, all_gather) with
    the installed logger, if it profiles it."""
    op = SHARED_MEMORY_PREFIX + kind
    if _active is not None and _active.profiles(op):
        _active.record(op, op, size_bytes, latency_ms, group_size)


def log_summary() -> None:
    """Print the installed logger's summary (on the ranks it prints on): DeepSpeed's
    ``deepspeed.comm.log_summary()``."""
    if _active is None:
        raise RuntimeError('log_summary: no communication logger is installed; set '
                           '"comms_logger": {"enabled": true} in the DeepSpeed config')
    if _active.log is not None:
        _active.log(_active.summary())
