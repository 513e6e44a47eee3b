"""The engine's ``save_checkpoint`` / ``load_checkpoint``: megazero's portable checkpoint
(:mod:`megazero.checkpoint`) in DeepSpeed's directory layout (``save_dir/<tag>/`` and a
``save_dir/latest`` file naming the newest tag).

Weights, fp32 masters and Adam moments are stored per parameter name (as ranges of its
flattened values, each written by the rank that owns it), so a checkpoint loads at another
data-parallel size or ZeRO stage. The engine's counters, the
schedule's state, each optimizer group's learning rate and the caller's ``client_state`` go to
``extra_state.pt``, written atomically by rank 0 and loaded with ``weights_only=True``: a
``client_state`` may hold tensors, numbers, strings, None and lists / tuples / dicts of them,
which is checked at save time (anything else could not be loaded without unpickling code).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from megazero import checkpoint
from megazero.checkpoint.reader import TAG_TRACKER
from megazero.errors import MegazeroError

_PLAIN = (int, float, bool, str, type(None), torch.Tensor, torch.Size, torch.dtype)


class ClientStateError(MegazeroError, TypeError):
    """A ``client_state`` value that a safe (weights_only) load could not read back."""


def check_plain(value: Any, where: str = "client_state") -> None:
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)):
                raise ClientStateError(f"{where} has a key of type {type(k).__name__}; use "
                                       "str / int keys")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise ClientStateError(f"{where} is a {type(value).__name__}; checkpoints are loaded without "
                           "unpickling code, so client_state may hold only tensors, numbers, "
                           "strings, None and lists / tuples / dicts of them (store its "
                           "state_dict() or a plain value instead)")


def _scheduler_state(sched: Any) -> Any:
    if sched is None:
        return None
    state = sched.state_dict()
    try:
        check_plain(state, "lr_scheduler.state_dict()")
    except ClientStateError:
        warnings.warn("the lr scheduler's state_dict() holds objects a safe load cannot read; "
                      "it is not saved (the schedule restarts on load)", stacklevel=4)
        return None
    return state


def save(engine: Any, save_dir: str, tag: str | None, client_state: dict[str, Any],
         save_latest: bool) -> str:
    check_plain(client_state)
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    if not tag or os.sep in tag or tag in (".", ".."):
        raise MegazeroError(f"checkpoint tag {tag!r} is not a directory name; use a plain name "
                            "such as 'step100'")
    extra = {"client_state": client_state,
             "engine": {"global_steps": engine.global_steps,
                        "global_samples": engine.global_samples,
                        "micro_steps": engine.micro_steps,
                        "skipped_steps": engine.skipped_steps},
             "lrs": [float(g["lr"]) for g in engine.optimizer.param_groups],
             "lr_scheduler": _scheduler_state(engine.lr_scheduler)}
    os.makedirs(save_dir, exist_ok=True)
    latest = os.path.join(save_dir, TAG_TRACKER)
    before = open(latest, encoding="utf-8").read() if (
        not save_latest and os.path.isfile(latest)) else None
    directory = checkpoint.save_checkpoint(
        save_dir, engine.global_steps, engine.topo, models=[engine.module],
        optimizer=engine.optimizer, scheduler=None, consumed_samples=engine.global_samples,
        config=engine.config, zero_stage=engine.zero_optimization_stage(), tag=tag,
        extra_state=extra)
    if not save_latest and engine.global_rank == 0:
        if before is None:
            os.remove(latest)
        else:
            checkpoint.Writer().text(before, latest)
    return directory


def load(engine: Any, load_dir: str, tag: str | None, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str | None, Any]:
    if tag is None:
        latest = os.path.join(load_dir, TAG_TRACKER)
        if not os.path.isfile(latest):
            warnings.warn(f"no checkpoint to load: {latest} does not exist; pass tag= or "
                          "save a checkpoint first", stacklevel=3)
            return None, None
        tag = open(latest, encoding="utf-8").read().strip()
    res = checkpoint.load_checkpoint(
        load_dir, engine.topo, models=[engine.module], optimizer=engine.optimizer,
        scheduler=None, zero_stage=engine.zero_optimization_stage(),
        no_load_optim=not load_optimizer_states or load_module_only,
        finetune=load_module_only, config=engine.config, tag=tag)
    extra = res.extra_state or {}
    if not load_module_only:
        for k, v in extra.get("engine", {}).items():
            setattr(engine, k, int(v))
        if load_lr_scheduler_states:
            groups = list(engine.optimizer.param_groups)
            if engine._lr_source is not None:  # a client scheduler steers these groups
                groups += list(engine._lr_source.param_groups)
            lrs = extra.get("lrs", [])
            for i, g in enumerate(groups):
                if lrs:
                    g["lr"] = lrs[i % len(lrs)]
            state = extra.get("lr_scheduler")
            if engine.lr_scheduler is not None and state is not None:
                engine.lr_scheduler.load_state_dict(state)
    return res.path, extra.get("client_state", {})
