"""Loading a checkpoint at any layout: every rank checks and opens what it needs (no
collectives), all ranks agree it worked, then the state is applied (the format:
:mod:`megazero.checkpoint`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megazero.checkpoint.common import (
    config_dict,
    gather_all,
    is_engine,
    layout_of,
    local_shapes,
    rank_dir,
    replica_coord,
)
from megazero.checkpoint.reader import TAG_TRACKER, read_meta, read_meta_at
from megazero.checkpoint.restore import load_optimizer_states, load_weights
from megazero.checkpoint.rng import set_rng_state
from megazero.checkpoint.shard_reader import ShardReader
from megazero.checkpoint.tensors import param_infos
from megazero.errors import CheckpointError
from megazero.optim.onebit_state import check_error_feedback, load_error_feedback

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


# Settings that change the model's tensors; a difference is named instead of a shape error.
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "num_query_groups", "vocab_size", "max_position_embeddings",
              "position_embedding_type", "normalization", "swiglu", "add_bias_linear",
              "untie_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm")


@dataclass(frozen=True)
class LoadResult:
    iteration: int
    consumed_samples: int
    path: str
    notes: list[str] = field(default_factory=list)  # what was not restored, and why
    extra_state: Any = None  # what the saver passed as ``extra_state`` (None if nothing)


def _config_difference(saved: Any, current: Any) -> str | None:
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return None
    a, b = saved.get("model") or {}, current.get("model") or {}
    for k in SHAPE_KEYS:
        if k in a and k in b and a[k] != b[k]:
            return (f"--{k.replace('_', '-')} is {b[k]} but the checkpoint was saved with "
                    f"{a[k]} (config.json)")
    wa, wb = _head_width(a), _head_width(b)
    if wa is not None and wb is not None and wa != wb:
        return (f"--kv-channels (the head width) is {wb} but the checkpoint was saved with "
                f"{wa} (config.json)")
    return None


def _head_width(m: dict[str, Any]) -> int | None:
    """``--kv-channels``, or hidden / heads when unset (a config without them: None)."""
    try:
        return int(m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _describe(layout: dict[str, Any]) -> str:
    return (f"tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} vpp={layout['vpp']} "
            f"zero_stage={layout['zero_stage']}")


def _same_ranks(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    return all(saved[k] == current[k] for k in ("tp", "pp", "dp", "vpp"))


def _rng_source(saved: dict[str, Any], current: dict[str, Any], c: Any
                ) -> tuple[int, int, int] | None:
    """The saved rank whose random states this rank continues, as (tp, pp, dp), or None.

    Every stream is seeded from the (tp, pp, vpp chunk) coordinate alone (the seed plus
    ``100 * pp_rank`` plus the chunk's first layer, ``+ 2718 + tp_rank`` for the model-parallel
    stream) and every data-parallel replica draws the same masks the same number of times, so
    the ranks of one (tp, pp) coordinate hold equal states whatever dp is. A run at the same tp,
    pp and vpp (any dp, ZeRO stage or offload) therefore continues the streams of saved data-
    parallel rank 0 (its own rank when dp is unchanged). At another tp, pp or vpp a stream
    covers other layers or heads: there is nothing to continue. Megatron-LM does the same: its
    RNG states are one object per (pp, tp) with dp as replicas, restored only when the saved tp
    and pp equal the run's ("(TP, PP) mismatch after resume: RNG state will be ignored"); it
    ignores vpp because its streams are per rank, where ours are per chunk.
    """
    if any(saved[k] != current[k] for k in ("tp", "pp", "vpp")):
        return None
    return c.tp, c.pp, c.dp if saved["dp"] == current["dp"] else 0


def load_checkpoint(root: str, topo: ParallelTopology, *, models: Sequence[torch.nn.Module],
                    optimizer: Any, scheduler: Any, zero_stage: int = 0, rng_tracker: Any = None,
                    no_load_optim: bool = False, no_load_rng: bool = False,
                    finetune: bool = False, iteration: int | None = None, config: Any = None,
                    gather: Callable[[Any], list[Any]] = gather_all,
                    tag: str | None = None) -> LoadResult | None:
    """Restore the newest complete checkpoint under ``root`` (or ``iteration``), at any layout.

    Returns ``None`` when ``root`` holds no checkpoint (a fresh start, as in Megatron).
    ``finetune`` loads the weights only and restarts at iteration 0. Collective: every rank
    reads what it needs, then all ranks agree it worked before any state is changed.
    ``tag``: load ``root/<tag>`` (a checkpoint saved with ``tag``) instead of an iteration.
    """
    plan: dict[str, Any] | None = None
    error = None
    try:
        plan = _plan(root, topo, list(models), optimizer, zero_stage, rng_tracker,
                     no_load_optim, no_load_rng, finetune, iteration, config, tag)
    except CheckpointError as e:
        error = str(e)
    errors = [(r, e) for r, e in enumerate(gather(error)) if e is not None]
    found = gather(plan is not None and plan.get("found", False))
    if errors:
        raise CheckpointError(errors[0][1])  # the same message on every rank
    if not any(found):
        return None
    return _apply(plan, list(models), optimizer, scheduler, rng_tracker)


def _plan(root, topo: ParallelTopology, models, optimizer, zero_stage, rng_tracker,
          no_load_optim, no_load_rng, finetune, iteration, config, tag=None) -> dict[str, Any]:
    """Phase 1, no collectives: read and check everything this rank needs."""
    if tag is not None:
        directory = os.path.join(root, tag)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint tag {tag!r} not found: {directory} does not "
                                  "exist; pass an existing tag, or tag=None for the one "
                                  f"{os.path.join(root, TAG_TRACKER)} names")
        meta = read_meta_at(directory, f"tag {tag!r}")
        iteration = int(meta["iteration"])
    else:
        found = read_meta(root, iteration)
        if found is None:
            return {"found": False}
        iteration, directory, meta = found
    reader = ShardReader(directory, meta)
    saved_cfg = reader.json("config.json")
    now_cfg = config_dict(config) if config is not None else None
    diff = _config_difference(saved_cfg, now_cfg)
    if diff:
        raise CheckpointError(f"checkpoint {directory} holds another model: {diff}; use the "
                              "saved settings or another --load directory")
    engine = optimizer if is_engine(optimizer) else None
    load_optim = not (no_load_optim or finetune) and optimizer is not None
    current = layout_of(topo, zero_stage)
    saved = meta["layout"]
    notes: list[str] = []
    if load_optim and engine is None and meta["opaque_optimizer"] and saved != current:
        raise CheckpointError(
            f"checkpoint {directory} was saved at layout {_describe(saved)}, but this run is "
            f"{_describe(current)}; its optimizer state is saved per rank, so it loads only at "
            "the saved layout (or use --no-load-optim / --finetune)")
    if load_optim and engine is not None and not meta["has_optimizer"]:
        raise CheckpointError(f"checkpoint {directory} holds weights only (no optimizer state); "
                              "load it with --finetune or --no-load-optim")
    if load_optim and engine is not None:
        _check_optimizer_kind(meta, engine.masters.kind, directory)
    c = replica_coord(topo)
    infos = param_infos(models, c.pp, topo.pp_size)
    missing = [i.name for i in infos if i.name not in meta["tensors"]]
    if missing:
        raise CheckpointError(f"checkpoint {directory} has no tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + "; it was saved from another model")
    shapes = local_shapes(infos, engine)
    for i in infos:  # checked and opened (checksums) here; read in _apply, range by range
        local = tuple(shapes[id(i.param)])
        want = i.global_shape(local, topo.tp_size)
        have = meta["tensors"][i.name]["shape"]
        if list(want) != list(have):
            raise CheckpointError(f"checkpoint {directory}: tensor {i.name} has shape {have}, "
                                  f"this model's is {want}")
        kinds = ["weight"]
        if load_optim and engine is not None and i.param.requires_grad:
            if not meta["tensors"][i.name].get("optim"):
                raise CheckpointError(f"checkpoint {directory} has no optimizer state for "
                                      f"{i.name}; load with --no-load-optim")
            kinds.append("optim")
        for kind in kinds:
            for rel in reader.files_of(i.name, kind):
                reader.file(rel)
    rank_file = None
    if (not finetune) and load_optim and engine is None and _same_ranks(saved, current):
        rank_file = reader.file(f"{rank_dir(c.tp, c.pp, c.dp)}/optim_rng.pt")
    errors = None  # OneBitAdam's error feedback: only at the same ranks, refused at another dp
    if load_optim and engine is not None and engine.masters.kind.name in (
            "OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        own = _same_ranks(saved, current)
        errors = reader.file(f"{rank_dir(*((c.tp, c.pp, c.dp) if own else (0, 0, 0)))}"
                             "/optim_rng.pt").get("error_feedback")
        if not own:
            check_error_feedback(errors, saved, current, directory)
    rng = None
    if not finetune and not no_load_rng:
        source = _rng_source(saved, current, c)
        if source is None:
            notes.append(f"random states not restored: saved at {_describe(saved)}, running at "
                         f"{_describe(current)}; the dropout streams of a (tp, pp, vpp chunk) "
                         "coordinate have no counterpart at another tp, pp or vpp, so they "
                         "restart from the seed")
        else:
            rng = reader.file(f"{rank_dir(*source)}/optim_rng.pt")["rng"]
    scaler_state = meta["loss_scaler"] if load_optim else None
    if engine is not None and load_optim:
        was_fp16 = bool((saved_cfg.get("precision") or {}).get("fp16"))
        if engine.precision.fp16 and not was_fp16:
            scaler_state = None
            notes.append("the checkpoint was not trained with --fp16: the loss scaler starts "
                         "from the configured initial scale")
    extra = reader.file("extra_state.pt") if "extra_state.pt" in meta["files"] else None
    return {"found": True, "iteration": iteration, "directory": directory, "meta": meta,
            "extra": extra,
            "finetune": finetune, "load_optim": load_optim, "reader": reader,
            "shapes": shapes, "rank_file": rank_file, "rng": rng, "errors": errors,
            "infos": infos, "engine": engine, "scaler": scaler_state, "notes": notes,
            "tp_rank": c.tp, "tp_size": topo.tp_size}


def _check_optimizer_kind(meta: dict[str, Any], kind: Any, directory: str) -> None:
    """The optimizer state loads only into the optimizer that wrote it (a checkpoint that
    names none was written by Adam or AdamW, whose state is the same)."""
    from megazero.zero.optimizers import LEGACY_STATE

    saved = meta.get("optimizer")
    if saved == kind.name or (saved is None and kind.state == LEGACY_STATE):
        return
    raise CheckpointError(f"checkpoint {directory} holds the optimizer state of "
                          f"{saved or 'Adam/AdamW'}; this run's optimizer is {kind.name}: use "
                          f"the same optimizer, or load the weights alone with --no-load-optim "
                          "(or --finetune)")


@torch.no_grad()
def _apply(plan, models, optimizer, scheduler, rng_tracker) -> LoadResult:
    """Phase 2: put the checked state into the model, engine, scheduler and RNGs."""
    engine, infos, reader, shapes = plan["engine"], plan["infos"], plan["reader"], plan["shapes"]
    tp = (plan["tp_rank"], plan["tp_size"])
    load_weights(reader, infos, shapes, engine, *tp)
    meta, directory = plan["meta"], plan["directory"]
    if plan["finetune"]:
        return LoadResult(0, 0, directory, plan["notes"], plan["extra"])
    if plan["load_optim"]:
        if engine is not None:
            load_optimizer_states(reader, infos, shapes, engine, *tp)
            load_error_feedback(engine, infos, plan["errors"])
            if plan["scaler"] is not None:
                engine.scaler.load_state_dict(plan["scaler"])
        elif plan["rank_file"] is not None and plan["rank_file"]["optimizer"] is not None:
            optimizer.load_state_dict(plan["rank_file"]["optimizer"])
        if scheduler is not None and meta["scheduler"] is not None:
            scheduler.load_state_dict(meta["scheduler"])
    if plan["rng"] is not None:
        set_rng_state(plan["rng"], rng_tracker)
    return LoadResult(int(meta["iteration"]), int(meta["consumed_samples"]), directory,
                      plan["notes"], plan["extra"])
