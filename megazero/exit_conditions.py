"""Exit conditions of a training run: SIGTERM, ``--exit-duration-in-mins``, ``--exit-interval``.

They are agreed by every rank through one small all-reduce per iteration, so all ranks stop
after the same iteration and save the same checkpoint.
"""

from __future__ import annotations

import signal
import time
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
