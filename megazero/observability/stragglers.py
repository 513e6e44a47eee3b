"""Which rank is slow: Megatron's ``--log-straggler``.

A rank that computes slowly (a throttled GPU or CPU, a noisy neighbour, a sleeping process)
makes every other rank wait for it in the next collective, so every rank's iteration takes
the same wall time and the log line cannot tell who it was. What differs is where the time
goes: the slow rank is busy, the others wait. :class:`WaitClock` adds up the seconds this
process's main thread spends blocked in ``torch.distributed`` (a synchronous collective or
point-to-point call, ``wait()`` on an asynchronous handle, a barrier), without changing what
overlaps what; an iteration's *busy time* is its wall time minus that.

Every log interval :class:`StragglerWatch` gathers each rank's mean busy time per iteration (one
small all-gather) and rank 0 logs the fastest and slowest ranks (``--straggler-minmax-count``
of each) and their spread. A rank whose busy time stays above ``--straggler-factor`` times the
other ranks' median for ``--straggler-patience`` intervals in a row is named once in a
warning; a healthy
run, whose ranks differ by noise, never is.

On GPUs the collectives are asynchronous to the host, so the wait shows up where the host
waits for the device; the busy time is then a host-side view (Megatron's detector times
kernels instead). On CPU ranks (gloo) it is exact.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: the ``torch.distributed`` calls that may block the caller
BLOCKING = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
            "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce",
            "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
            "barrier", "all_gather_object", "broadcast_object_list")


class _TimedWork:
    """A work handle whose ``wait`` adds to the clock."""

    def __init__(self, work: Any, clock: WaitClock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.add(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class WaitClock:
    """Seconds the installing thread spent blocked in ``torch.distributed`` since :meth:`take`.

    Installing replaces the functions in the ``torch.distributed`` namespace, as the comms
    logger does (:mod:`megazero.observability.comms_logging`); calls from other threads are
    passed through untimed."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._thread = threading.get_ident()

    def add(self, seconds: float) -> None:
        if threading.get_ident() == self._thread:
            self._seconds += seconds

    def take(self) -> float:
        out, self._seconds = self._seconds, 0.0
        return out

    def install(self) -> WaitClock:
        self._thread = threading.get_ident()
        for name in BLOCKING:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dist, name, self._timed(fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.add(time.perf_counter() - start)
            if hasattr(result, "wait") and not isinstance(result, torch.Tensor):
                return _TimedWork(result, self)
            if isinstance(result, list) and result and all(hasattr(w, "wait") for w in result):
                return [_TimedWork(w, self) for w in result]
            return result

        return timed


@dataclass(frozen=True)
class StragglerSettings:
    minmax_count: int = 1  # slowest and fastest ranks listed each interval
    factor: float = 3.0  # busy time over this many times the median is slow
    patience: int = 3  # intervals in a row before the warning


def describe(busy: list[float], minmax_count: int) -> str:
    """The straggler line: fastest and slowest ranks' busy time per iteration, median, spread."""
    order = sorted(range(len(busy)), key=lambda r: busy[r])
    k = max(1, min(minmax_count, len(busy)))
    fast = ", ".join(f"rank {r} {busy[r] * 1e3:.1f} ms" for r in order[:k])
    slow = ", ".join(f"rank {r} {busy[r] * 1e3:.1f} ms" for r in reversed(order[-k:]))
    med = statistics.median(busy)
    spread = busy[order[-1]] / busy[order[0]] if busy[order[0]] > 0 else float("inf")
    return (f"stragglers: busy time per iteration (wall time minus waits in collectives): "
            f"fastest {fast}; slowest {slow}; median {med * 1e3:.1f} ms; spread "
            f"{spread:.2f}x")


class StragglerWatch:
    """Per-rank busy time over each log interval (see the module docstring)."""

    def __init__(self, settings: StragglerSettings, rank: int, world_size: int,
                 device: torch.device, log: Callable[[str], None] | None,
                 warn: Callable[[str], None] | None) -> None:
        self.settings, self.rank, self.world_size, self.device = settings, rank, world_size, device
        self.log = log or (lambda _line: None)
        self.warn = warn or (lambda _line: None)
        self.clock = WaitClock()
        self.busy = 0.0
        self.iterations = 0
        self.slow_streak: dict[int, int] = {}
        self.named: set[int] = set()

    def install(self) -> StragglerWatch:
        self.clock.install()
        return self

    def uninstall(self) -> None:
        self.clock.uninstall()

    def iteration_started(self) -> None:
        self.clock.take()

    def iteration_done(self, wall_seconds: float) -> None:
        self.busy += max(0.0, wall_seconds - self.clock.take())
        self.iterations += 1

    def report(self) -> list[float]:
        """Collective, at a log interval: every rank's mean busy time per iteration; rank 0
        logs the line and, once per rank, the warning. Returns the gathered times."""
        mine = torch.tensor([self.busy / max(1, self.iterations)], dtype=torch.float64,
                            device=self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        if self.world_size > 1:
            dist.all_gather(out, mine)  # through the clock: its wait is not counted below
        else:
            out = [mine]
        self.clock.take()
        self.busy, self.iterations = 0.0, 0
        busy = [float(t.item()) for t in out]
        if self.rank == 0:
            self.log(describe(busy, self.settings.minmax_count))
        for r, b in enumerate(busy):
            med = statistics.median(busy[:r] + busy[r + 1:]) if len(busy) > 1 else b
            slow = med > 0 and b > self.settings.factor * med
            self.slow_streak[r] = self.slow_streak.get(r, 0) + 1 if slow else 0
            if self.slow_streak[r] >= self.settings.patience and r not in self.named:
                self.named.add(r)
                if self.rank == 0:
                    self.warn(f"rank {r} is a straggler: its busy time per iteration "
                              f"({b * 1e3:.1f} ms) has been more than "
                              f"{self.settings.factor:g}x the other ranks' median "
                              f"({med * 1e3:.1f} ms) for "
                              f"{self.slow_streak[r]} log intervals in a row; the others wait "
                              f"for it in every collective (check its host, GPU clocks and "
                              f"neighbours)")
        return busy
