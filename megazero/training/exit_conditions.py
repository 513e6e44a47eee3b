"""Exit conditions of a training run: SIGTERM, ``--exit-duration-in-mins``, ``--exit-interval``.

They are agreed by every rank through the iteration's one scalar all-reduce (with the loss, see
:func:`megazero.training.step.train_step`), so all ranks stop after the same iteration and save the
same checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


@dataclass
class ExitFlags:
    """Set from the SIGTERM handler; read once per iteration (no module-level state)."""

    sigterm: bool = False
    previous: Any = None

    def install(self) -> None:
        def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
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


def exit_votes(train_cfg: Any, flags: ExitFlags, start: float) -> list[float]:
    """This rank's ``[SIGTERM received, over --exit-duration-in-mins]``, as 0/1; summed over
    every rank (alone or inside the iteration's one scalar all-reduce) they decide for all."""
    t = train_cfg
    over_time = (t.exit_duration_in_mins is not None
                 and (time.time() - start) / 60.0 > t.exit_duration_in_mins)
    return [float(flags.sigterm), float(over_time)]


def exit_decision(train_cfg: Any, iteration: int, votes: list[float]) -> tuple[bool, str]:
    """Whether to stop after ``iteration``, from the votes summed over every rank."""
    t = train_cfg
    if votes[0] > 0:
        return True, "received SIGTERM"
    if votes[1] > 0:
        return True, f"exceeded --exit-duration-in-mins {t.exit_duration_in_mins}"
    if t.exit_interval and iteration % t.exit_interval == 0:
        return True, f"reached --exit-interval {t.exit_interval}"
    return False, ""


def should_exit(train_cfg: Any, iteration: int, flags: ExitFlags, start: float,
                topo: ParallelTopology, device: torch.device) -> tuple[bool, str]:
    """All ranks agree (one all-reduce) on SIGTERM, the duration limit and the exit interval."""
    v = torch.tensor(exit_votes(train_cfg, flags, start), device=device)
    if topo.world_size > 1:
        dist.all_reduce(v)
    return exit_decision(train_cfg, iteration, v.tolist())
