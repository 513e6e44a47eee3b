"""Save and load training state in a layout-independent ("portable") format, atomically.

::

    SAVE/latest_checkpointed_iteration.txt     "10": the newest complete checkpoint
    SAVE/.megazero-run.lock                    the run writing here (one at a time, see
                                               :mod:`megazero.checkpoint.ownership`)
    SAVE/iter_0000010/metadata.json            index of every tensor + file checksums, the
                                               run id that wrote it; written
                                               last, so its presence means "complete"
    SAVE/iter_0000010/config.json              the run's configuration
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/model_NNN.pt
                                               {"<global name>@<lo>": {"weight": 1-D range}}:
                                               the ranges of the weights' TP shards this rank
                                               owns, one file per I/O bucket
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/optim_NNN.pt
                                               the same for {master, exp_avg, exp_avg_sq, step}
                                               (Adam; SGD: {master, momentum_buffer}; Lion:
                                               {master, exp_avg})
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/optim_rng.pt
                                               each rank's RNG states (and the state of an
                                               optimizer that is not the ZeRO engine)
    SAVE/iter_0000010/extra_state.pt           optional: the caller's own state (the
                                               DeepSpeed-style engine's counters and
                                               ``client_state``), written by rank 0

With ``tag`` (the DeepSpeed-style engine) the directory is ``SAVE/<tag>`` and the tracker is
``SAVE/latest`` holding the tag, as DeepSpeed lays them out; the files inside are the same.

**Portable.** Every tensor is saved under its global name (its key in the tp=1, pp=1 model)
with the index recording its global shape (vocabulary padding stripped), TP split dim and
stride; see :mod:`megazero.checkpoint.tensors`. Each rank writes the flat ranges of each
parameter's TP shard that it owns (its ZeRO pieces: fp32 masters, moments and, at stages 1-3,
the weights of those ranges), from where they live, one I/O bucket at a time, and the index
lists every range (:mod:`megazero.checkpoint.save_ranges`); a save adds one bucket of host
memory and reduces nothing over dp but the step count. The ranges are cut by dp, the stage
and the buckets, but the index describes each as elements ``[lo, hi)`` of a named TP shard, so
nothing a reader needs depends on them. A loading rank computes the tensors it needs and
reads only those (``torch.load(mmap=True)``), range by range, straight into the parameters,
ZeRO-3 partitions and optimizer pieces that keep them (:mod:`megazero.checkpoint.restore`): no
rank builds the model, and its memory rises by little more than the Adam moments it creates.
Format version 2 (one whole TP piece per ``mp_rank_TT_PPP/model.pt`` / ``optim.pt``, written
by dp rank 0) still loads.
Weights, masters, Adam moments and step, the loss scaler, the scheduler and consumed samples
load at any tp / pp / vpp / dp / ZeRO stage / offload.
Random states are saved per rank and restored at the same tp, pp and vpp, whatever dp or the
ZeRO stage (see :func:`_rng_source` for why that is well defined and where it stops).

Why our own index rather than ``torch.distributed.checkpoint``: DCP's planner resolves
overlapping reads collectively and needs a process group to read, while this format must also
be read by one process with no ``torch.distributed`` (:func:`read_model_state`, the converter);
its flattened-shard support also doesn't cover TP strides or vocabulary un-padding. The index
is one JSON file a person can read.

**Safe.** Files are data: ``torch.load(weights_only=True)`` only (RNG states stored as tensors
and lists). ``metadata.json`` holds every file's size and SHA-256, checked before use. A rank
that cannot load reports its error and every rank raises the same :class:`CheckpointError`
(errors are gathered before anything is applied), so no rank goes on with half a checkpoint.

**Refused whole.** ``metadata.json`` names the format and its version; an index of another
version (older or newer), another format, or a directory another tool wrote (Megatron-LM's
``mp_rank_00/model_optim_rng.pt``, DeepSpeed's ``latest`` tag) is refused in one line naming the
file and what to do, before anything is read (:func:`megazero.checkpoint.reader.check_format`).

**Crash-safe.** Files are written under temporary names and renamed; every rank meets at a
barrier; only then rank 0 writes ``metadata.json`` and the ``latest`` pointer, and removes
temporaries left by earlier crashed saves. A crash at any point leaves ``latest`` naming the
previous complete checkpoint. Writes go through an injectable ``writer`` (tests crash it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megazero.checkpoint.files import (
    CheckpointError,
    Writer,
    remove_stale_tmp,
    sha256,
)
from megazero.checkpoint.reader import (
    FORMAT,
    MARKER,
    TAG_TRACKER,
    TRACKER,
    VERSION,
    ShardReader,
    iteration_dir,
    meta_digest,
    read_global_tensors,
    read_meta,
    read_meta_at,
    read_model_state,
    read_tracker,
)
from megazero.checkpoint.restore import load_optimizer_states, load_weights
from megazero.checkpoint.rng import get_rng_state, set_rng_state
from megazero.checkpoint.save_ranges import (
    DEFAULT_BUCKET_BYTES,
    merge_index,
    step_count,
    write_rank_tensors,
)
from megazero.checkpoint.tensors import ParamInfo, param_infos
from megazero.optim.onebit_state import (
    check_error_feedback,
    error_feedback_state,
    load_error_feedback,
)
from megazero.save_check import explain_write_error

if TYPE_CHECKING:
    from megazero.topology import ParallelTopology
    from megazero.zero.optimizer import ZeroOptimizer

__all__ = ["CheckpointError", "LoadResult", "Writer", "config_dict", "iteration_dir",
           "load_checkpoint", "read_global_tensors", "read_model_state", "read_tracker",
           "save_checkpoint",
           "write_model_state", "TRACKER", "MARKER"]

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


def _pair_dir(tp: int, pp: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}"


def _rank_dir(tp: int, pp: int, dp: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}_{dp:03d}"


def _replica_coord(topo: ParallelTopology) -> Any:
    """This rank's coordinate with ``dp`` the index among the ranks holding the same weights
    (data replicas x context-parallel ranks: what ZeRO shards over). At cp = 1 the coordinate
    itself; with CP a checkpoint is laid out as if those ranks were data replicas, so it
    loads at any cp."""
    return topo.coord._replace(dp=topo.grad_rank)


def layout_of(topo: ParallelTopology, zero_stage: int) -> dict[str, Any]:
    return {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.grad_size,
            "vpp": topo.vpp_size or 1, "zero_stage": zero_stage}


def config_dict(config: Any) -> Any:
    """A dataclass config as plain JSON values (for config.json and experiment trackers)."""
    if is_dataclass(config):
        config = asdict(config)

    def value(o: Any) -> Any:  # a dataclass inside a plain dict (a model's MoE section)
        return asdict(o) if is_dataclass(o) and not isinstance(o, type) else str(o)

    return json.loads(json.dumps(config, default=value))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _is_engine(optimizer: Any) -> bool:
    from megazero.zero.optimizer import ZeroOptimizer

    return isinstance(optimizer, ZeroOptimizer)


def _local_shapes(infos: list[ParamInfo], engine: ZeroOptimizer | None
                  ) -> dict[int, torch.Size]:
    """Each parameter's TP-shard shape (stage 3 releases ``.data`` to 0 elements)."""
    shapes = {id(i.param): i.param.shape for i in infos}
    if engine is not None:
        for store in engine.stores:
            shapes.update(store.param_shapes())
    return shapes


def _remove_debris(root: str, directory: str) -> None:
    """Temporaries of earlier crashed saves: in this iteration's directory and the tracker's."""
    remove_stale_tmp(directory)
    for name in os.listdir(root):
        if name.startswith((TRACKER + ".tmp.", TAG_TRACKER + ".tmp.")):
            os.remove(os.path.join(root, name))


# --- save -----------------------------------------------------------------------------------

def _raise_first(problems: list[str | None]) -> None:
    for p in problems:
        if p:
            raise CheckpointError(p)


def _write_index(w: Writer, root: str, directory: str, iteration: int, gathered: list[Any],
                 config: Any, consumed_samples: int, topo: ParallelTopology, zero_stage: int,
                 scheduler: Any, engine: Any, has_optimizer: bool, tag: str | None = None,
                 version: int = VERSION, run_id: str | None = None) -> None:
    """Rank 0, once every rank's files are on disk: config.json, metadata.json (the index and
    checksums; its presence means "complete"), then the ``latest`` pointer (the iteration
    tracker, or with ``tag`` DeepSpeed's ``latest`` tag file). ``version``: the format version
    the entries follow (an older one only for the test reference of an older writer)."""
    tensors = merge_index([idx for idx, _, _, _ in gathered])
    all_files: dict[str, Any] = {}
    for _, fl, _, _ in gathered:
        all_files.update(fl)
    config_path = os.path.join(directory, "config.json")
    w.text(json.dumps(config_dict(config), indent=1), config_path)
    all_files["config.json"] = {"sha256": sha256(config_path),
                                "bytes": os.path.getsize(config_path)}
    meta = {"format": FORMAT, "version": version, "iteration": iteration,
            "consumed_samples": consumed_samples, "layout": layout_of(topo, zero_stage),
            "world_size": topo.world_size,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "loss_scaler": engine.scaler.state_dict() if engine is not None else None,
            "has_optimizer": has_optimizer, "opaque_optimizer": any(g[3] for g in gathered),
            "optimizer": engine.masters.kind.name if engine is not None else None,
            "run_id": run_id, "tensors": tensors, "files": all_files}
    meta["sha256"] = meta_digest(meta)
    w.text(json.dumps(meta, indent=1), os.path.join(directory, MARKER))
    if tag is not None:
        w.text(tag, os.path.join(root, TAG_TRACKER))
    else:
        w.text(str(iteration), os.path.join(root, TRACKER))
    _remove_debris(root, directory)


def save_checkpoint(root: str, iteration: int, topo: ParallelTopology, *,
                    models: Sequence[torch.nn.Module], optimizer: Any, scheduler: Any,
                    consumed_samples: int, config: Any,
                    zero_stage: int = 0, rng_tracker: Any = None,
                    barrier: Callable[[], None] = _barrier,
                    gather: Callable[[Any], list[Any]] = _gather,
                    writer: Writer | None = None, tag: str | None = None,
                    extra_state: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    run_id: str | None = None) -> str:
    """Collective: every rank calls it. Returns the iteration directory.

    ``tag``: save under ``root/<tag>`` and point ``root/latest`` at it (DeepSpeed's layout)
    instead of ``iter_<iteration>`` and the iteration tracker. ``extra_state``: rank 0's
    tensors / numbers / strings / lists / dicts, saved beside (loadable with weights_only).
    ``bucket_bytes``: the most tensor bytes a rank copies to the host before writing them as
    one file (the host memory a save adds; see :mod:`megazero.checkpoint.save_ranges`).
    ``run_id``: the run that writes it (:mod:`megazero.checkpoint.ownership`), recorded in
    ``metadata.json``."""
    w = writer if writer is not None else Writer()
    c = _replica_coord(topo)
    directory = os.path.join(root, tag) if tag is not None else iteration_dir(root, iteration)
    engine = optimizer if _is_engine(optimizer) else None
    if engine is not None:
        engine.wait_for_params()  # the weights are read below, outside any forward
    infos = [i for i in param_infos(list(models), c.pp, topo.pp_size) if not i.duplicate]
    shapes = _local_shapes(infos, engine)
    step = step_count(engine, infos) if engine is not None else None  # collective over dp
    index: dict[str, Any] = {}
    files: dict[str, Any] = {}

    def put(obj: Any, rel: str) -> None:
        path = os.path.join(directory, rel)
        w.torch(obj, path)
        files[rel] = {"sha256": sha256(path), "bytes": os.path.getsize(path)}

    problem = None  # why this rank's files could not be written (a full disk, a quota...)
    try:
        # each rank writes the ranges it owns, from where they live, a bucket at a time
        index = write_rank_tensors(infos, shapes, engine, step, c.tp, topo.tp_size, c.dp,
                                   _rank_dir(c.tp, c.pp, c.dp), bucket_bytes, put,
                                   edp_rank=topo.edp_rank if topo.edp_group is not None
                                   else None)
        opaque = None if optimizer is None or engine is not None else optimizer.state_dict()
        put({"rng": get_rng_state(rng_tracker), "optimizer": opaque, "iteration": iteration,
             # 1-bit optimizers: this rank's error-feedback buffers (megazero.optim.onebit_state)
             "error_feedback": error_feedback_state(engine, infos)},
            f"{_rank_dir(c.tp, c.pp, c.dp)}/optim_rng.pt")
        if extra_state is not None and topo.rank == 0:
            put(extra_state, "extra_state.pt")
    except (OSError, RuntimeError) as e:  # reported on every rank below; a death passes
        problem, opaque = explain_write_error(root, iteration, e), None
    barrier()  # every shard is on disk before the checkpoint is declared complete
    gathered = gather((index, files, problem, opaque is not None))
    # A rank that could not write makes every rank raise (none waits at a barrier for it),
    # before anything declares this checkpoint complete.
    _raise_first([p for _, _, p, _ in gathered])
    if topo.rank == 0:
        try:
            _write_index(w, root, directory, iteration, gathered, config, consumed_samples,
                         topo, zero_stage, scheduler, engine, optimizer is not None, tag,
                         run_id=run_id)
        except (OSError, RuntimeError) as e:  # as above
            problem = explain_write_error(root, iteration, e)
    _raise_first(gather(problem if topo.rank == 0 else None))
    return directory


def write_model_state(root: str, config: dict, state: dict[str, torch.Tensor],
                      iteration: int = 0) -> str:
    """A weights-only portable checkpoint, as if saved by one process: global names and
    unpadded vocabulary, no optimizer state. ``pretrain_gpt.py --load root --finetune`` (or
    ``--no-load-optim``) loads it at any layout. Returns the iteration directory."""
    w = Writer()
    directory = iteration_dir(root, iteration)
    vocab = (config.get("model") or {}).get("vocab_size")
    rel = f"{_pair_dir(0, 0)}/model.pt"
    tensors = {}
    for name, t in state.items():
        is_vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        tensors[name] = {"shape": list(t.shape), "dim": None, "stride": 1, "tp": 1,
                         "vocab": vocab if is_vocab else None, "dtype": str(t.dtype),
                         "optim": False, "dirs": [_pair_dir(0, 0)]}
    w.torch({k: v.detach().cpu().contiguous() for k, v in state.items()},
            os.path.join(directory, rel))
    w.text(json.dumps(config_dict(config), indent=1), os.path.join(directory, "config.json"))
    files = {r: {"sha256": sha256(os.path.join(directory, r)),
                 "bytes": os.path.getsize(os.path.join(directory, r))}
             for r in (rel, "config.json")}
    meta = {"format": FORMAT, "version": VERSION, "iteration": iteration, "consumed_samples": 0,
            "layout": {"tp": 1, "pp": 1, "dp": 1, "vpp": 1, "zero_stage": 0}, "world_size": 1,
            "scheduler": None, "loss_scaler": None, "has_optimizer": False,
            "opaque_optimizer": False, "tensors": tensors, "files": files}
    meta["sha256"] = meta_digest(meta)
    w.text(json.dumps(meta, indent=1), os.path.join(directory, MARKER))
    w.text(str(iteration), os.path.join(root, TRACKER))
    _remove_debris(root, directory)
    return directory


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


# --- load ------------------------------------------------------------------------------------

def load_checkpoint(root: str, topo: ParallelTopology, *, models: Sequence[torch.nn.Module],
                    optimizer: Any, scheduler: Any, zero_stage: int = 0, rng_tracker: Any = None,
                    no_load_optim: bool = False, no_load_rng: bool = False,
                    finetune: bool = False, iteration: int | None = None, config: Any = None,
                    gather: Callable[[Any], list[Any]] = _gather,
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
    engine = optimizer if _is_engine(optimizer) else None
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
    c = _replica_coord(topo)
    infos = param_infos(models, c.pp, topo.pp_size)
    missing = [i.name for i in infos if i.name not in meta["tensors"]]
    if missing:
        raise CheckpointError(f"checkpoint {directory} has no tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + "; it was saved from another model")
    shapes = _local_shapes(infos, engine)
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
        rank_file = reader.file(f"{_rank_dir(c.tp, c.pp, c.dp)}/optim_rng.pt")
    errors = None  # OneBitAdam's error feedback: only at the same ranks, refused at another dp
    if load_optim and engine is not None and engine.masters.kind.name in (
            "OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        own = _same_ranks(saved, current)
        errors = reader.file(f"{_rank_dir(*((c.tp, c.pp, c.dp) if own else (0, 0, 0)))}"
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
            rng = reader.file(f"{_rank_dir(*source)}/optim_rng.pt")["rng"]
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
