"""Exclusive wall-clock regions for ``wall_clock_breakdown``, without stalling a GPU.

A region boundary takes a *mark* from a clock: on CPU the host's clock (``perf_counter``); on
CUDA an event recorded on the current stream, so a boundary costs a few microseconds and never
waits for the device (the old rule, ``torch.cuda.synchronize()`` at every boundary, serialised
the gradient hooks with the backward and made the breakdown change what it measured). The
stretches between marks are resolved into seconds once, when the breakdown is read
(:meth:`Timers.pop_all`, once per logged iteration), after one wait for the last mark.

Events time the stream, which is what a GPU run spends: a region covers the kernels its code
launched, and a stretch where the stream ran dry (the host was late) is charged to the region
whose code was running. A collective's ``wait`` region on NCCL is the time the compute stream
stalled behind it (``work.wait()`` makes the current stream wait for the communication
stream; the mark after it completes once the collective has).

In-flight time of an asynchronous collective (:meth:`Timers.time_in_flight`) runs from its
launch to its completion. On NCCL the work's future completes when the work is enqueued, so
the host clock in its callback would measure nothing; instead the callback records an event on
the stream torch hands future callbacks, which waits for the communication to finish
(``torch.futures.Future.add_done_callback``: "behaves in the same way as then" for GPU
tensors), and that event is the end. On CPU (gloo) the future completes when the data has
arrived, and the host clock in its callback is the end, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch


class HostClock:
    """Marks are ``perf_counter`` readings; nothing to resolve."""

    deferred = False

    def mark(self) -> Any:
        return time.perf_counter()

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        return float(b - a)

    def wait(self, mark: Any) -> None:
        pass

    def release(self, marks: list[Any]) -> None:
        pass


class EventClock:
    """Marks are CUDA events recorded on the current stream; reused once resolved."""

    deferred = True

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def new_event(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def mark(self) -> Any:
        ev = self.new_event()
        ev.record()
        return ev

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1000.0

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def release(self, marks: list[Any]) -> None:
        with self._lock:
            self._free.extend(marks)


def clock_for(device: torch.device | None) -> HostClock | EventClock:
    return EventClock() if device is not None and device.type == "cuda" else HostClock()


class Timers:
    """Exclusive wall-clock regions (``wall_clock_breakdown``).

    A region started inside another pauses it, so every second of an iteration is charged to
    exactly one region (the innermost open one) and the regions add up to the time they cover
    without double counting: ``backward`` wrapping the whole pipeline schedule ends up holding
    only what its ``forward``, ``data`` and collective regions did not take. ``device``: the
    rank's device; CUDA regions are timed by events (see the module docstring).

    Asynchronous collectives also report their *in-flight* time (launch to completion) through
    :meth:`time_in_flight` (or :meth:`add_overlapped` with seconds measured elsewhere): that
    time runs beside the regions and is reported apart from them (it is the transfer time; the
    ``wait`` regions are what the rank actually lost to it).
    """

    def __init__(self, enabled: bool = True, device: torch.device | None = None,
                 clock: HostClock | EventClock | None = None) -> None:
        self.enabled = enabled
        self.clock = clock if clock is not None else clock_for(device)
        self._stack: list[list[Any]] = []  # [name, mark at the start of the current stretch]
        self._pending: list[tuple[str, Any, Any]] = []  # stretches not yet resolved (events)
        self._total: dict[str, float] = {}
        self._overlapped: dict[str, float] = {}
        self._flights: list[tuple[str, Any, Any]] = []  # (label, start event, end event)
        self._lock = threading.Lock()

    def _charge(self, name: str, a: Any, b: Any) -> None:
        if self.clock.deferred:
            self._pending.append((name, a, b))
        else:
            self._total[name] = self._total.get(name, 0.0) + self.clock.seconds(a, b)

    def start(self, name: str) -> None:
        if not self.enabled:
            return
        now = self.clock.mark()
        if self._stack:  # the enclosing region pauses here
            top = self._stack[-1]
            self._charge(top[0], top[1], now)
            top[1] = now
        self._stack.append([name, now])

    def stop(self, name: str) -> None:
        """Close ``name`` (and any region left open inside it); the enclosing region resumes."""
        if not self.enabled:
            return
        idx = next((i for i in range(len(self._stack) - 1, -1, -1)
                    if self._stack[i][0] == name), None)
        if idx is None:
            return
        now = self.clock.mark()
        while len(self._stack) > idx:
            n, t0 = self._stack.pop()
            self._charge(n, t0, now)
            if self._stack:  # the enclosing region resumes here
                self._stack[-1][1] = now

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, no region starts or stops: the enclosing region takes all the time (an
        evaluation or a save is one line of the breakdown, not its forwards and collectives)."""
        old, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = old

    def add_overlapped(self, name: str, seconds: float) -> None:
        """In-flight time of an asynchronous operation (may be called from another thread)."""
        with self._lock:
            self._overlapped[name] = self._overlapped.get(name, 0.0) + seconds

    def time_in_flight(self, name: str, work: Any) -> None:
        """Charge ``work``'s launch-to-completion time to ``name`` (call right after issuing
        it). A work without a future (or whose future refuses callbacks) is not timed."""
        if not self.enabled or work is None or not hasattr(work, "get_future"):
            return
        with suppress(RuntimeError):
            fut = work.get_future()
            if isinstance(self.clock, EventClock):
                clock = self.clock
                start = clock.mark()  # the point of the compute stream the collective follows

                def done(_f: Any) -> None:
                    end = clock.new_event()
                    end.record()  # on the callback's stream, which waited for the collective
                    with self._lock:
                        self._flights.append((name, start, end))

                fut.add_done_callback(done)
            else:
                t0 = time.perf_counter()
                fut.add_done_callback(
                    lambda _f: self.add_overlapped(name, time.perf_counter() - t0))

    def pop_all(self) -> dict[str, float]:
        """Exclusive seconds per region since the last call; resets them. Regions still open
        are charged up to now and go on from here. With events this is where the breakdown waits
        for the device (for the marks it resolves), once per read."""
        if self._stack:
            now = self.clock.mark()
            top = self._stack[-1]
            self._charge(top[0], top[1], now)
            top[1] = now
        if self._pending:
            used = {id(m): m for _, a, b in self._pending for m in (a, b)}
            for m in used.values():  # marks may sit on different streams: wait for each
                self.clock.wait(m)
            for name, a, b in self._pending:
                self._total[name] = self._total.get(name, 0.0) + self.clock.seconds(a, b)
            open_marks = {id(entry[1]) for entry in self._stack}
            self.clock.release([m for k, m in used.items() if k not in open_marks])
            self._pending = []
        out, self._total = self._total, {}
        return out

    def pop_overlapped(self) -> dict[str, float]:
        with self._lock:
            flights, self._flights = self._flights, []
            out, self._overlapped = self._overlapped, {}
        for name, start, end in flights:
            self.clock.wait(end)
            out[name] = out.get(name, 0.0) + self.clock.seconds(start, end)
        self.clock.release([m for _, a, b in flights for m in (a, b)])
        return out
