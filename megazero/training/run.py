"""What one training run holds: :class:`Run` (the configuration, the layout, the model chunks,
the engine, the scheduler, the sinks) and :class:`TrainState` (where the run is).

Built by :func:`megazero.training.lifecycle.setup`; driven by :func:`megazero.training.loop.train`.
"""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megazero.checkpoint.async_save import AsyncSaver
from megazero.checkpoint.ownership import RunOwner, release
from megazero.config import MegazeroConfig
from megazero.config.layout import GROUP_KINDS
from megazero.config.rules import sequence_parallel_active
from megazero.distributed.startup import DistEnv
from megazero.distributed.topology import ParallelTopology
from megazero.observability.comms_logging import CommsLogger
from megazero.observability.monitor import Monitor, Timers
from megazero.observability.stragglers import StragglerWatch
from megazero.optim.lr_scheduler import LRScheduler
from megazero.training.builders import Batching
from megazero.training.divergence import SpikeWatch
from megazero.training.watchdog import Watchdog

if TYPE_CHECKING:
    from megazero.zero.optimizer import ZeroOptimizer

#: Iterations kept in :attr:`TrainState.history`: enough for tests and a post-mortem of the
#: last steps, bounded so a million-iteration run does not grow a million dicts.
HISTORY_LENGTH = 1000


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    exit_reason: str | None = None  # set when training stopped before --train-iters
    # The last HISTORY_LENGTH iterations' loss, grad norm, loss scale, skipped flag.
    history: deque[dict[str, float]] = field(
        default_factory=lambda: deque(maxlen=HISTORY_LENGTH))
    nonfinite_streak: int = 0  # NaN/inf steps in a row, reset by a finite one
    spikes: SpikeWatch = field(default_factory=SpikeWatch)  # steps not worth saving


@dataclass
class Run:
    """Everything one training run holds."""

    cfg: MegazeroConfig
    env: DistEnv
    topo: ParallelTopology
    batching: Batching
    chunks: list[torch.nn.Module]
    engine: ZeroOptimizer
    scheduler: LRScheduler
    monitor: Monitor
    timers: Timers
    train_ds: Any
    valid_ds: Any
    state: TrainState
    watchdog: Watchdog | None = None
    checkpoint_writer: Any = None  # a megazero.checkpoint.files.Writer; None = the default
    owner: RunOwner | None = None  # rank 0: the run holding the --save directory's lock
    eod_id: int | None = None  # the end-of-document id (packed documents kept apart)
    eod_mask: int | None = None  # --eod-mask-loss: the end-of-document id whose next is masked
    comms_logger: CommsLogger | None = None  # DeepSpeed's "comms_logger", while installed
    saver: AsyncSaver | None = None  # --async-save: the saves written in the background
    stragglers: StragglerWatch | None = None  # --log-straggler, while installed
    fp8: Any = None  # --fp8-format: the megazero.fp8.apply.FP8Layers of this rank's chunks

    def close(self) -> None:
        """Put torch.distributed's collectives back, close the log sinks, and give the
        ``--save`` directory's lock back."""
        if self.comms_logger is not None:
            self.comms_logger.uninstall()
        if self.stragglers is not None:  # installed before the comms logger
            self.stragglers.uninstall()
        self.monitor.close()
        if self.owner is not None and self.cfg.checkpoint.save:
            release(self.cfg.checkpoint.save, self.owner)
            self.owner = None

    @property
    def sp(self) -> bool:
        return sequence_parallel_active(self.cfg.parallel.sequence_parallel, self.topo.tp_size)

    def phase(self, what: str, group: str | None = None) -> AbstractContextManager[None]:
        """Mark what this rank is doing for the watchdog (``group``: the process group the
        phase waits on, named as in :mod:`megazero.distributed.topology`)."""
        if self.watchdog is None:
            return nullcontext()
        ranks = (self.topo.ranks(group) if group in GROUP_KINDS
                 else range(self.topo.world_size))
        return self.watchdog.phase(what, group, ranks)
