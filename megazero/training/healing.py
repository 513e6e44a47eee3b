"""Jobs that heal: a relaunch after a failure, at the same size or another, resumes by itself.

* **Restarts.** Under ``torchrun --max-restarts N`` a failed attempt's workers are started
  again with the same flags and ``TORCHELASTIC_RESTART_COUNT`` raised by one. A run that saves
  (``--save``) then resumes from the newest complete checkpoint there even without ``--load``
  (:func:`resume_after_restart`), and rank 0 says from where and why: the rank that reported
  the failure wrote it into ``--save`` (:func:`record_failure`) before the attempt ended. Keys
  in the job's store are per attempt (:func:`megazero.errors.attempt_key`, and the default
  group's own store prefix in :func:`megazero.distributed.startup.initialize_distributed`), so
  the new attempt never reads the old one's.
* **Another world size** (``torchrun --nnodes MIN:MAX``, or a relaunch on fewer nodes): the
  layout's tp, pp, cp and ep are the flags', the data-parallel size is what the world leaves,
  and the checkpoint reshards on load. The global batch is the user's: when it was derived
  (``micro x accumulation x dp``, no ``--global-batch-size``) a resume keeps the checkpoint's,
  with the micro-batches per step recomputed, or refuses in one line when it cannot be split
  over the new dp (:func:`keep_global_batch`); Megatron silently trains at the new size.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from megazero.checkpoint.files import Writer
from megazero.config import ConfigError, MegazeroConfig

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
#: what ended the previous attempt, written into --save by the rank that reported it
FAILURE_FILE = ".megazero-last-failure.json"


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """Which attempt of the job this is: 0 for the first launch."""
    try:
        return int(env.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


def restarts_left(env: Mapping[str, str] = os.environ) -> int:
    """How many more attempts the launcher will start after this one fails."""
    try:
        return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_count(env)
    except ValueError:
        return 0


def record_failure(save_dir: str | None, rank: int, message: str,
                   env: Mapping[str, str] = os.environ) -> None:
    """Keep why this attempt fails in ``save_dir`` for the next attempt to say, when the
    launcher will start one (best effort: a job that cannot write there has bigger problems,
    reported already)."""
    if not save_dir or not os.path.isdir(save_dir) or restarts_left(env) <= 0:
        return
    record = {"attempt": restart_count(env), "rank": rank, "message": message,
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        Writer().text(json.dumps(record), os.path.join(save_dir, FAILURE_FILE))
    except OSError:
        pass


def previous_failure(save_dir: str | None) -> dict[str, Any] | None:
    if not save_dir:
        return None
    try:
        with open(os.path.join(save_dir, FAILURE_FILE), encoding="utf-8") as f:
            record: dict[str, Any] = json.load(f)
            return record
    except (OSError, ValueError):
        return None


def resume_after_restart(cfg: MegazeroConfig, env: Mapping[str, str] = os.environ
                         ) -> tuple[MegazeroConfig, list[str]]:
    """A restarted attempt of a run that saves resumes from its ``--save`` directory; returns
    the config and the lines rank 0 logs about the restart."""
    attempt = restart_count(env)
    ck = cfg.checkpoint
    if attempt == 0 or not ck.save:
        return cfg, []
    lines = [f"> restart {attempt} of this job (torchrun --max-restarts)"]
    before = previous_failure(ck.save)
    if before is not None and before.get("attempt") == attempt - 1:
        lines.append(f"> the previous attempt ended at {before['time']}: rank {before['rank']} "
                     f"reported: {before['message']}")
    else:
        lines.append("> the previous attempt left no message (a rank was killed, or the "
                     "node went down)")
    if ck.load is None and not ck.finetune:
        cfg = replace(cfg, checkpoint=replace(ck, load=ck.save))
        lines.append(f"> resuming from the newest complete checkpoint in --save {ck.save} "
                     f"(no --load given)")
    return cfg, lines


def keep_global_batch(cfg: MegazeroConfig, saved: dict[str, Any] | None
                      ) -> tuple[MegazeroConfig, str | None]:
    """A resume whose global batch was derived from the layout (no ``--global-batch-size``)
    keeps the checkpoint's global batch at another data-parallel size; returns the config and
    the line to log (None when nothing changed)."""
    t, ck = cfg.train, cfg.checkpoint
    saved_train = (saved or {}).get("train") or {}
    old = saved_train.get("global_batch_size")
    if (not ck.load or ck.finetune or not t.global_batch_derived or not isinstance(old, int)
            or old == t.global_batch_size or t.rampup_batch_size is not None):
        return cfg, None
    dp, micro = cfg.parallel.dp, t.micro_batch_size
    if old % (micro * dp):
        fits = sorted({d for d in range(1, old + 1) if old % (micro * d) == 0})
        raise ConfigError(
            f"--load {ck.load} was trained with a global batch of {old} samples, which cannot "
            f"be split into micro-batches of {micro} over this run's data-parallel size {dp} "
            f"(world size {cfg.parallel.world_size}); pass --global-batch-size with a multiple "
            f"of {micro * dp} to train at another batch, or launch a world whose "
            f"data-parallel size is one of {fits}")
    count = old // (micro * dp)
    cfg = replace(cfg, train=replace(t, global_batch_size=old, gradient_accumulation_steps=count))
    return cfg, (f"> resuming at data-parallel size {dp}: the global batch stays the "
                 f"checkpoint's {old} ({count} micro-batches of {micro} per rank); "
                 f"--global-batch-size sets another")
