"""Checks made before resuming, so that a resumed run does not silently differ from the saved one.

* ``--load`` must exist, unless it is also ``--save``: a requeued job's first launch loads from
  the directory it is about to save to, which may not exist yet. A ``--load`` that names no
  directory is a typo, and training from scratch under it would waste the allocation.
  (Megatron warns and starts from random weights; here the path must be right.)
* ``--load`` must be a checkpoint directory (the one holding the tracker), not one of its
  iteration folders: ``--load ck/iter_0000040`` finds no tracker there, and starting from
  scratch would then save over ``ck``'s own iterations. It is refused naming ``ck``.
* ``--save`` must not hold checkpoints newer than where this run starts unless it is the
  ``--load`` directory (a resume) or ``--overwrite-checkpoints`` says so: a new run saved into
  an old run's directory overwrites its iterations one by one and moves ``latest`` back.
  (Megatron does that silently; torchtitan resumes instead.) A ``--save`` equal to ``--load``
  is a resume: checkpoints newer than the tracker are a rollback the user chose.
* The learning-rate schedule (peak and minimum rate, decay style, warm-up and decay steps) must
  match the checkpoint's, as in Megatron's ``OptimizerParamScheduler.load_state_dict``:
  ``--override-opt_param-scheduler`` takes the flags given now, ``--use-checkpoint-opt_param-
  scheduler`` takes the checkpoint's; without either, a difference is an error naming both.
  ``--train-iters`` only matters through the decay steps (``--lr-decay-iters``, default
  ``--train-iters``), so a longer run with a fixed ``--lr-decay-iters`` resumes freely.
  Nothing is compared with ``--finetune`` or ``--no-load-optim``: the schedule is not loaded then.

The checkpoint's settings are read from ``config.json`` of the iteration that ``latest`` names,
as plain JSON, so this works whatever the shard format is.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields, replace
from typing import Any

from megazero.config import ConfigError, MegazeroConfig, ModelConfig

TRACKER = "latest_checkpointed_iteration.txt"

#: schedule setting -> (flag, how to read it from a config (the dataclass or config.json dict))
_SCHEDULE = {
    "lr": "--lr",
    "min_lr": "--min-lr",
    "lr_decay_style": "--lr-decay-style",
    "lr_warmup_iters": "--lr-warmup-iters",
    "lr_decay_iters": "--lr-decay-iters",
}
#: compared when the checkpoint records them (older checkpoints predate them)
_SCHEDULE_LATER = {
    "lr_warmup_tokens": "--lr-warmup-tokens",
    "lr_decay_tokens": "--lr-decay-tokens",
    "decoupled_lr": "--decoupled-lr",
    "decoupled_min_lr": "--decoupled-min-lr",
}


_ITER = re.compile(r"iter_(\d{7,})")


def _checkpoint_root_of(path: str) -> tuple[str, int] | None:
    """(root, iteration) when ``path`` is one iteration folder of a megazero checkpoint
    directory: named ``iter_NNNNNNN`` with a ``metadata.json``, or inside a directory with a
    tracker."""
    path = os.path.normpath(os.path.abspath(path))
    m = _ITER.fullmatch(os.path.basename(path))
    if m is None:
        return None
    parent = os.path.dirname(path)
    if os.path.isfile(os.path.join(path, "metadata.json")) or os.path.isfile(
            os.path.join(parent, TRACKER)):
        return parent, int(m.group(1))
    return None


def check_load_path(cfg: MegazeroConfig) -> None:
    ck = cfg.checkpoint
    inside = _checkpoint_root_of(ck.load) if ck.load else None
    if inside is not None:
        root, iteration = inside
        latest = _tracker(root)
        which = (f"it resumes from iteration {latest}, the one {TRACKER} names" if latest
                 is not None else f"it has no {TRACKER} yet")
        pick = ("" if latest == iteration else f"; to resume from iteration {iteration} "
                f"instead, write {iteration} into {os.path.join(root, TRACKER)} first")
        raise ConfigError(f"--load {ck.load} is one iteration folder of the checkpoint "
                          f"directory {root}: pass --load {root} ({which}){pick}")
    if not ck.load or os.path.isdir(ck.load):
        return
    if ck.save and os.path.abspath(ck.save) == os.path.abspath(ck.load):
        return  # first launch of a job that saves and resumes in one directory
    if os.path.exists(ck.load):
        raise ConfigError(f"--load {ck.load}: not a directory; give the checkpoint directory "
                          f"(the one holding {TRACKER})")
    raise ConfigError(f"--load {ck.load}: no such directory; check the path, or drop --load to "
                      f"start from scratch (a --load equal to --save may not exist yet)")


def _tracker(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _complete(root: str) -> list[int]:
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        m = _ITER.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, "metadata.json")):
            out.append(int(m.group(1)))
    return sorted(out)


def check_save_path(cfg: MegazeroConfig) -> None:
    """``--save`` holds no checkpoint newer than where this run starts (module docstring)."""
    ck = cfg.checkpoint
    if not ck.save or ck.overwrite_checkpoints or not os.path.isdir(ck.save):
        return
    same = bool(ck.load) and os.path.abspath(str(ck.load)) == os.path.abspath(ck.save)
    if same:
        return
    start = 0
    if ck.load and not ck.finetune:
        start = _tracker(ck.load) or 0
    done = _complete(ck.save)
    newer = [i for i in done if i > start]
    if not newer:
        return
    latest = _tracker(ck.save)
    held = (f"checkpoints up to iteration {newer[-1]}" + (f" (latest: {latest})" if latest
                                                          is not None else ""))
    if not ck.load:
        start_text = "this run starts from scratch (no --load)"
    elif ck.finetune:
        start_text = f"this run starts at iteration 0 (--load {ck.load} with --finetune)"
    else:
        start_text = f"this run starts from --load {ck.load} at iteration {start}"
    raise ConfigError(f"--save {ck.save} already holds {held}, and {start_text}: saving there "
                      f"would overwrite them. To resume that run, add --load {ck.save}; to start "
                      f"a new run over them, add --overwrite-checkpoints; or give another --save")


def saved_config(load_dir: str) -> dict[str, Any] | None:
    """The ``config.json`` of the newest checkpoint in ``load_dir``, or None."""
    try:
        with open(os.path.join(load_dir, TRACKER), encoding="utf-8") as f:
            iteration = int(f.read().strip())
        with open(os.path.join(load_dir, f"iter_{iteration:07d}", "config.json"),
                  encoding="utf-8") as f:
            saved: dict[str, Any] = json.load(f)
            return saved
    except (OSError, ValueError):
        return None


def saved_progress(load_dir: str | None) -> tuple[int, int] | None:
    """``(iteration, consumed samples)`` of the newest checkpoint in ``load_dir``, or None."""
    if not load_dir:
        return None
    try:
        with open(os.path.join(load_dir, TRACKER), encoding="utf-8") as f:
            iteration = int(f.read().strip())
        with open(os.path.join(load_dir, f"iter_{iteration:07d}", "metadata.json"),
                  encoding="utf-8") as f:
            meta = json.load(f)
        return int(meta["iteration"]), int(meta["consumed_samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _schedule(optimizer: dict[str, Any], train_iters: Any, names: dict[str, str]
              ) -> dict[str, Any]:
    out = {name: optimizer.get(name) for name in names}
    out["lr_decay_iters"] = out["lr_decay_iters"] or train_iters  # the effective decay steps
    return out


def check_schedule(cfg: MegazeroConfig, saved: dict[str, Any] | None) -> MegazeroConfig:
    """``cfg``, with the checkpoint's schedule when asked; raise on an unrequested change."""
    ck = cfg.checkpoint
    if ck.override_opt_param_scheduler and ck.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-"
                          "scheduler contradict each other; give one of them")
    if saved is None or ck.finetune or ck.no_load_optim or ck.override_opt_param_scheduler:
        return cfg
    old_opt = saved.get("optimizer") or {}
    if not all(name in old_opt for name in _SCHEDULE):
        return cfg  # a checkpoint without these settings: nothing to compare with
    names = {**_SCHEDULE, **{k: v for k, v in _SCHEDULE_LATER.items() if k in old_opt}}
    old = _schedule(old_opt, (saved.get("train") or {}).get("train_iters"), names)
    o = cfg.optimizer
    new = _schedule({name: getattr(o, name) for name in names}, cfg.train.train_iters, names)
    if ck.use_checkpoint_opt_param_scheduler:
        return replace(cfg, optimizer=replace(o, **{k: old[k] for k in names}))
    diffs = [f"{names[k]} {new[k]} (checkpoint: {old[k]})" for k in names
             if new[k] != old[k] and not (k == "lr_decay_iters" and None in (new[k], old[k]))]
    if diffs:
        raise ConfigError(f"--load {ck.load}: the learning-rate schedule differs from the "
                          f"checkpoint's: {'; '.join(diffs)} (the decay steps default to "
                          f"--train-iters). Add --override-opt_param-scheduler to use the new "
                          f"values, or --use-checkpoint-opt_param-scheduler to keep the "
                          f"checkpoint's")
    return cfg


def use_checkpoint_args(cfg: MegazeroConfig, saved: dict[str, Any] | None) -> MegazeroConfig:
    """``--use-checkpoint-args``: the model section of the checkpoint's config replaces the
    flags' (Megatron's ``load_args_from_checkpoint``); the vocabulary still comes from the
    tokenizer, and the layout checks run again on the result."""
    if not cfg.checkpoint.use_checkpoint_args:
        return cfg
    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint to read the "
                          "model's settings from)")
    if saved is None or not isinstance(saved.get("model"), dict):
        raise ConfigError(f"--use-checkpoint-args: no checkpoint with a config.json in "
                          f"{cfg.checkpoint.load}; give the model flags instead")
    names = {f.name for f in fields(ModelConfig)} - {"vocab_size"}
    model = replace(cfg.model, **{k: v for k, v in saved["model"].items() if k in names})
    p = cfg.parallel
    if model.moe.num_experts is None and p.expert_model_parallel_size * (
            p.expert_tensor_parallel_size) > 1:
        raise ConfigError(f"--expert-model-parallel-size {p.expert_model_parallel_size} x "
                          f"--expert-tensor-parallel-size {p.expert_tensor_parallel_size} "
                          f"needs a Mixture-of-Experts model, and the checkpoint in "
                          f"{cfg.checkpoint.load} has none; drop the flags")
    return replace(cfg, model=model)


def check_resume(cfg: MegazeroConfig) -> MegazeroConfig:
    """All the checks above; the config to train with."""
    check_load_path(cfg)
    check_save_path(cfg)
    if cfg.checkpoint.load and os.path.isdir(cfg.checkpoint.load):
        from megazero.checkpoint.reader import refuse_foreign

        refuse_foreign(cfg.checkpoint.load)  # a foreign or unknown format: refused first
    saved = saved_config(cfg.checkpoint.load) if cfg.checkpoint.load else None
    cfg = use_checkpoint_args(cfg, saved)
    if not cfg.checkpoint.load:
        return cfg
    return check_schedule(cfg, saved)
