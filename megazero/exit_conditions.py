"""Exit conditions of a training run: SIGTERM, ``--exit-duration-in-mins``, ``--exit-interval``.

They are agreed by every rank through one small all-reduce per iteration, so all ranks stop
after the same iteration and save the same checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ExitFlags:
    """Set from the SIGTERM handler; read once per iteration (no module-level state)."""

    sigterm: bool = False
    previous: Any = None

    def install(self) -> None:
        def handler(signum, frame):  # noqa: ARG001
            self.sigterm = True

        self.previous = signal.signal(signal.SIGTERM, handler)

    def uninstall(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold SIGTERM over the block and deliver it after (to the previous handler).

    Why: when a peer dies, ``torchrun`` sends SIGTERM to the survivors at once. A survivor
    that has just left the training loop (whose handler only sets a flag) is about to print
    the one line naming the dead peer; the default action would end it silently first."""
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if got:
            os.kill(os.getpid(), signal.SIGTERM)


def should_exit(train_cfg: Any, iteration: int, flags: ExitFlags, start: float, topo: Any,
                device: torch.device) -> tuple[bool, str]:
    """All ranks agree (MAX all-reduce) on SIGTERM, the duration limit and the exit interval."""
    t = train_cfg
    over_time = (t.exit_duration_in_mins is not None
                 and (time.time() - start) / 60.0 > t.exit_duration_in_mins)
    v = torch.tensor([float(flags.sigterm), float(over_time)], device=device)
    if topo.world_size > 1:
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if v[0] > 0:
        return True, "received SIGTERM"
    if v[1] > 0:
        return True, f"exceeded --exit-duration-in-mins {t.exit_duration_in_mins}"
    if t.exit_interval and iteration % t.exit_interval == 0:
        return True, f"reached --exit-interval {t.exit_interval}"
    return False, ""
