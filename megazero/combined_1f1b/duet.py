"""Two micro-batches' passes that take turns at their all-to-alls.

:func:`run_pair` runs a forward (one micro-batch) and a backward (another) as a *duet*: the
backward on the calling thread, the forward on a helper thread, and exactly one of them running
at any time. A pass gives the turn away only inside :func:`exchange`: it starts its all-to-all,
lets the other pass compute until that one starts its own, and then waits for its transfer. So
each all-to-all travels while the other micro-batch computes, and the order in which a rank
issues its collectives is fixed by the code, the same on every rank of a group (what NCCL
needs), never by thread timing.

The turns follow the layers, as megatron-core's combined 1F1B and DeepSeek's DualPipe order
them. The backward starts, runs the loss and the last layer's output part, and starts the
combine's backward all-to-all; the forward then runs its attention and router and starts its
dispatch; the backward runs its experts' backward and starts the dispatch's backward; the
forward runs its experts and starts its combine; and so on down and up the layers. When one pass
ends, the other runs to its end alone, its remaining all-to-alls waited for at once.

The turns change only at the all-to-alls: between a layer's router and its experts, and
between its experts and the combine. Every module that owns parameters (norms, attention,
router, experts, shared experts) therefore runs its forward, and its backward, inside one turn,
and ZeRO-3's per-module gathers and releases of the two passes never cross.

The forward's thread is a plain Python thread: torch's grad mode is per thread and on by
default there (a duet only runs in training), and the CUDA device, also per thread, is set to
the caller's; nothing else the model reads is per thread. On a GPU both passes enqueue on the
current stream and the all-to-alls run on the communicator's own stream. A backward's
all-to-all may run on autograd's device thread instead of the calling one: every thread that
is not the forward's counts as the backward's side.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megazero.tensor_parallel.overlap import InFlight, compute_window

FORWARD, BACKWARD = 0, 1


class Duet:
    """The turn between a forward and a backward pass (see the module docstring)."""

    def __init__(self) -> None:
        self._turn = (threading.Semaphore(0), threading.Semaphore(0))
        self._running = [True, True]
        self._lock = threading.Lock()
        self.forward_thread: int | None = None
        self.handovers = 0

    def side(self) -> int:
        return FORWARD if threading.get_ident() == self.forward_thread else BACKWARD

    def hand_over(self) -> bool:
        """Let the other pass run until it hands the turn back (or ends); False, at once, once
        it has ended. The time away is recorded as this rank's compute while tracing."""
        me = self.side()
        with self._lock:
            if not self._running[1 - me]:
                return False
        t0 = time.perf_counter()
        self._turn[1 - me].release()
        self._turn[me].acquire()
        compute_window(t0, time.perf_counter())
        return True

    def start(self, side: int) -> None:
        """Wait for the first turn (the forward's thread, before it runs anything)."""
        self._turn[side].acquire()

    def end(self, side: int) -> None:
        """This pass is done: the other one, if waiting for its turn, runs to its end."""
        with self._lock:
            self._running[side] = False
            wake = self._running[1 - side]
        if wake:
            self._turn[1 - side].release()


_current: list[Duet] = []


def current() -> Duet | None:
    """The duet running now, if any (both passes and autograd's threads see it)."""
    return _current[-1] if _current else None


@contextlib.contextmanager
def _active(duet: Duet) -> Iterator[Duet]:
    _current.append(duet)
    try:
        yield duet
    finally:
        _current.remove(duet)


def run_pair(forward: Callable[[], Any], backward: Callable[[], Any]) -> None:
    """Run ``backward()`` here and ``forward()`` on a helper thread, taking turns at the
    all-to-alls (:func:`exchange`). The backward goes first. An exception in either pass is
    raised here once both have stopped."""
    duet = Duet()
    failed: list[BaseException] = []
    device = _current_cuda_device()

    def forward_side() -> None:
        duet.start(FORWARD)
        try:
            if device is not None:  # the current device is per thread; cuda:0 in a new one
                torch.cuda.set_device(device)
            forward()
        except BaseException as e:  # raised again on the calling thread
            failed.append(e)
        finally:
            duet.end(FORWARD)

    with _active(duet):
        thread = threading.Thread(target=forward_side, name="megazero-combined-1f1b-forward",
                                  daemon=True)
        thread.start()
        duet.forward_thread = thread.ident
        try:
            backward()
        finally:
            duet.end(BACKWARD)
            thread.join()
    if failed:
        raise failed[0]


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, when CUDA is in use (what ``torch.device("cuda")``,
    the RNG tracker's CUDA states and the current stream refer to in that thread)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return torch.cuda.current_device()
    return None


def exchange(start: Callable[[], Any], name: str, alone: str) -> None:
    """Start an asynchronous collective (``start()`` returns its work handle), give the turn
    to the other pass of the running duet, then wait for the transfer; traced as ``name``.
    Outside a duet, or once the other pass has ended, the wait follows the start at once,
    traced as ``alone``."""
    t0 = time.perf_counter()
    work = start()
    duet = current()
    handed = duet is not None and duet.hand_over()
    InFlight(name if handed else alone, [work], t0).wait()
