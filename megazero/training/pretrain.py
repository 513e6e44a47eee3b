"""``pretrain_gpt.py``'s run: set up, train, evaluate once more, leave the process group.

:func:`pretrain` is the whole of it; its parts are :mod:`.lifecycle` (start and end),
:mod:`.loop` (the iterations), :mod:`.step` (one iteration, evaluation) and :mod:`.save_policy`
(when to save and load).
"""

from __future__ import annotations

import os
import sys
import traceback

from megazero.config import MegazeroConfig
from megazero.distributed.startup import free_destroyed_groups
from megazero.errors import claim_report, expected_errors
from megazero.training.divergence import TrainingDivergedError
from megazero.training.exit_conditions import sigterm_deferred
from megazero.training.healing import record_failure
from megazero.training.lifecycle import setup, shutdown
from megazero.training.loop import train
from megazero.training.run import Run, TrainState
from megazero.training.step import evaluate
from megazero.training.watchdog import WATCHDOG_EXIT_CODE


def pretrain(cfg: MegazeroConfig, log_json: str | None = None) -> TrainState:
    """Set up, train, evaluate once more at the end, close the sinks, leave the process group.

    The orderly exit (every rank finished, or every rank agreed the run diverged) ends with a
    barrier and then ``destroy_process_group``: no rank tears down its connections while a peer
    still talks to it (gloo aborts such a peer with "terminate called without an active
    exception"). Any other error skips the barrier, since its peers may never reach it; the
    entry point destroys the group and the watchdog ends a peer left waiting.
    """
    run = setup(cfg, log_json)
    diverged: TrainingDivergedError | None = None
    try:
        state = _train_or_explain(run)
        # An early exit (pre-emption, time limit) leaves right after its checkpoint.
        if state.exit_reason is None and cfg.train.eval_iters > 0 and (
                not cfg.train.eval_interval or state.iteration % cfg.train.eval_interval):
            with run.phase(f"final evaluation at iteration {state.iteration}", "mp"):
                val = evaluate(run)
            if val is not None:
                run.monitor.report_validation(state.iteration, val,
                                              consumed_samples=state.consumed_samples)
        if run.comms_logger is not None:
            run.comms_logger.uninstall()
            run.monitor.info("communication summary (rank 0, from the end of setup to the end "
                             f"of training):\n{run.comms_logger.summary()}")
    except TrainingDivergedError as e:  # every rank raised it: the exit is orderly
        diverged = e
        traceback.clear_frames(e.__traceback__)  # the frames the error passed hold the run
    finally:
        run.close()
    shutdown(run)
    del run
    free_destroyed_groups()
    if diverged is not None:
        raise diverged
    return state


def _train_or_explain(run: Run) -> TrainState:
    """:func:`train`; a collective that fails inside a watched phase (the backend's timeout,
    a peer that closed its connection) ends this rank with one line naming the phase and the
    group instead of a traceback. The group is broken then: nothing is torn down in order.
    Of the ranks that see the failure (every survivor, and the ranks that then see a survivor
    leave), the first to claim the job's error slot speaks; the others exit quietly. The
    launcher's SIGTERM, sent as soon as a peer died, waits until that line is out."""
    with sigterm_deferred():
        try:
            return train(run)
        except RuntimeError as e:
            if isinstance(e, expected_errors()):  # agreed by every rank (a write error)
                raise
            watchdog = run.watchdog
            reason = watchdog.failure_message(e) if watchdog is not None else None
            if watchdog is None or reason is None:
                raise
            watchdog.stop()  # one message: not the watchdog's as well
            if watchdog.take_voice() and claim_report(run.env.rank, unsure=True):
                print(reason, file=sys.stderr, flush=True)
                record_failure(run.cfg.checkpoint.save, run.env.rank, reason)
            run.monitor.close()
            os._exit(WATCHDOG_EXIT_CODE)
