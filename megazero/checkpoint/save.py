"""Saving a checkpoint: each rank writes the ranges it owns, every rank meets, then rank 0
writes the index and moves the tracker (the format: :mod:`megazero.checkpoint`)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megazero.checkpoint.common import (
    barrier,
    config_dict,
    gather_all,
    is_engine,
    layout_of,
    local_shapes,
    pair_dir,
    rank_dir,
    remove_debris,
    replica_coord,
)
from megazero.checkpoint.files import Writer, mark_in_progress, sha256
from megazero.checkpoint.reader import (
    FORMAT,
    MARKER,
    TAG_TRACKER,
    TRACKER,
    VERSION,
    iteration_dir,
    meta_digest,
)
from megazero.checkpoint.rng import get_rng_state
from megazero.checkpoint.save_check import explain_write_error
from megazero.checkpoint.save_ranges import (
    DEFAULT_BUCKET_BYTES,
    merge_index,
    step_count,
    write_rank_tensors,
)
from megazero.checkpoint.tensors import param_infos
from megazero.errors import CheckpointError
from megazero.optim.onebit_state import error_feedback_state

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


def _raise_first(problems: list[str | None]) -> None:
    for p in problems:
        if p:
            raise CheckpointError(p)


def run_state(scheduler: Any, engine: Any) -> dict[str, Any]:
    """What the index records of the run besides the tensors, as it is now: the scheduler's
    and the loss scaler's state and the optimizer's kind."""
    return {"scheduler": scheduler.state_dict() if scheduler is not None else None,
            "loss_scaler": engine.scaler.state_dict() if engine is not None else None,
            "optimizer": engine.masters.kind.name if engine is not None else None}


def _write_index(w: Writer, root: str, directory: str, iteration: int, gathered: list[Any],
                 config: Any, consumed_samples: int, topo: ParallelTopology, zero_stage: int,
                 state: dict[str, Any], has_optimizer: bool, tag: str | None = None,
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
            "world_size": topo.world_size, "scheduler": state["scheduler"],
            "loss_scaler": state["loss_scaler"], "has_optimizer": has_optimizer,
            "opaque_optimizer": any(g[3] for g in gathered), "optimizer": state["optimizer"],
            "run_id": run_id, "tensors": tensors, "files": all_files}
    meta["sha256"] = meta_digest(meta)
    w.text(json.dumps(meta, indent=1), os.path.join(directory, MARKER))
    if tag is not None:
        w.text(tag, os.path.join(root, TAG_TRACKER))
    else:
        w.text(str(iteration), os.path.join(root, TRACKER))
    remove_debris(root, directory)


@dataclass
class RankSave:
    """One rank's part of one save: decided (collectively) before any file is written, then
    filled by :func:`write_rank_files` with the index entries of the ranges it saves and the
    name, size and checksum of each file once written. A synchronous save writes the files as
    they are produced; an asynchronous one (:mod:`megazero.checkpoint.async_save`) keeps them
    in host memory and writes them in the background. The files are the same either way."""

    root: str
    iteration: int
    directory: str
    infos: list[Any]
    shapes: dict[int, torch.Size]
    step: float | None
    coord: Any
    engine: Any
    optimizer: Any
    rng_tracker: Any
    extra_state: Any
    bucket_bytes: int
    tp_size: int
    edp_rank: int | None
    index: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)
    opaque: bool = False  # an optimizer that is not the ZeRO engine saved its state per rank
    problem: str | None = None  # why this rank's files could not be written

    def result(self) -> tuple[dict[str, Any], dict[str, Any], str | None, bool]:
        """What rank 0 needs of this rank to commit the save (gathered over ranks)."""
        return self.index, self.files, self.problem, self.opaque


def prepare_save(root: str, iteration: int, topo: ParallelTopology, *,
                 models: Sequence[torch.nn.Module], optimizer: Any, rng_tracker: Any = None,
                 tag: str | None = None, extra_state: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> RankSave:
    """Collective (the optimizer's step count over dp): what this rank saves and where."""
    c = replica_coord(topo)
    directory = os.path.join(root, tag) if tag is not None else iteration_dir(root, iteration)
    engine = optimizer if is_engine(optimizer) else None
    if engine is not None:
        engine.wait_for_params()  # the weights are read below, outside any forward
    infos = [i for i in param_infos(list(models), c.pp, topo.pp_size) if not i.duplicate]
    shapes = local_shapes(infos, engine)
    step = step_count(engine, infos) if engine is not None else None  # collective over dp
    return RankSave(root, iteration, directory, infos, shapes, step, c, engine, optimizer,
                    rng_tracker, extra_state if topo.rank == 0 else None, bucket_bytes,
                    topo.tp_size, topo.edp_rank if topo.edp_group is not None else None)


def rank_small_files(plan: RankSave) -> list[tuple[Any, str]]:
    """This rank's files besides its ranges, taken now (copies: training goes on after an
    asynchronous save step): its random states and the state of an optimizer that is not the
    engine, and rank 0's ``extra_state``."""
    c, engine, optimizer = plan.coord, plan.engine, plan.optimizer
    opaque = None if optimizer is None or engine is not None else copy.deepcopy(
        optimizer.state_dict())
    plan.opaque = opaque is not None
    out: list[tuple[Any, str]] = [(
        {"rng": get_rng_state(plan.rng_tracker), "optimizer": opaque,
         "iteration": plan.iteration,
         # 1-bit optimizers: this rank's error-feedback buffers (megazero.optim.onebit_state)
         "error_feedback": error_feedback_state(engine, plan.infos)},
        f"{rank_dir(c.tp, c.pp, c.dp)}/optim_rng.pt")]
    if plan.extra_state is not None:
        out.append((copy.deepcopy(plan.extra_state), "extra_state.pt"))
    return out


def write_rank_ranges(plan: RankSave, put: Callable[[Any, str], None]) -> None:
    """Produce the files of the ranges this rank owns, from where they live, a bucket at a
    time, handing each to ``put(obj, relative path)``; fills ``plan.index``."""
    c = plan.coord
    plan.index = write_rank_tensors(plan.infos, plan.shapes, plan.engine, plan.step, c.tp,
                                    plan.tp_size, c.dp, rank_dir(c.tp, c.pp, c.dp),
                                    plan.bucket_bytes, put, edp_rank=plan.edp_rank)


def write_rank_files(plan: RankSave, put: Callable[[Any, str], None]) -> None:
    """Produce all of this rank's files, handing each to ``put(obj, relative path)``: its
    ranges (:func:`write_rank_ranges`), then its small files (:func:`rank_small_files`)."""
    write_rank_ranges(plan, put)
    for obj, rel in rank_small_files(plan):
        put(obj, rel)


def write_file(w: Writer, plan: RankSave, obj: Any, rel: str) -> None:
    """Write one file of ``plan`` atomically and record its size and checksum."""
    path = os.path.join(plan.directory, rel)
    w.torch(obj, path)
    plan.files[rel] = {"sha256": sha256(path), "bytes": os.path.getsize(path)}


def commit_save(w: Writer, plan: RankSave, gathered: list[Any], topo: ParallelTopology, *,
                config: Any, consumed_samples: int, zero_stage: int, state: dict[str, Any],
                tag: str | None = None, run_id: str | None = None) -> str | None:
    """Rank 0, once every rank's files are complete: the index, then the tracker. ``state``:
    :func:`run_state` as of the save step. Returns why it could not (one line), or None."""
    try:
        _write_index(w, plan.root, plan.directory, plan.iteration, gathered, config,
                     consumed_samples, topo, zero_stage, state, plan.optimizer is not None,
                     tag, run_id=run_id)
    except (OSError, RuntimeError) as e:  # a full disk, a directory gone
        return explain_write_error(plan.root, plan.iteration, e)
    return None


def save_checkpoint(root: str, iteration: int, topo: ParallelTopology, *,
                    models: Sequence[torch.nn.Module], optimizer: Any, scheduler: Any,
                    consumed_samples: int, config: Any,
                    zero_stage: int = 0, rng_tracker: Any = None,
                    barrier: Callable[[], None] = barrier,
                    gather: Callable[[Any], list[Any]] = gather_all,
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
    plan = prepare_save(root, iteration, topo, models=models, optimizer=optimizer,
                        rng_tracker=rng_tracker, tag=tag, extra_state=extra_state,
                        bucket_bytes=bucket_bytes)
    try:
        mark_in_progress(plan.directory, run_id)
        write_rank_files(plan, lambda obj, rel: write_file(w, plan, obj, rel))
    except (OSError, RuntimeError) as e:  # reported on every rank below; a death passes
        plan.problem, plan.opaque = explain_write_error(root, iteration, e), False
    barrier()  # every shard is on disk before the checkpoint is declared complete
    gathered = gather(plan.result())
    # A rank that could not write makes every rank raise (none waits at a barrier for it),
    # before anything declares this checkpoint complete.
    _raise_first([p for _, _, p, _ in gathered])
    problem = None
    if topo.rank == 0:
        problem = commit_save(w, plan, gathered, topo, config=config,
                              consumed_samples=consumed_samples, zero_stage=zero_stage,
                              state=run_state(scheduler, plan.engine), tag=tag, run_id=run_id)
    _raise_first(gather(problem if topo.rank == 0 else None))
    return plan.directory


def write_model_state(root: str, config: dict, state: dict[str, torch.Tensor],
                      iteration: int = 0) -> str:
    """A weights-only portable checkpoint, as if saved by one process: global names and
    unpadded vocabulary, no optimizer state. ``pretrain_gpt.py --load root --finetune`` (or
    ``--no-load-optim``) loads it at any layout. Returns the iteration directory."""
    w = Writer()
    directory = iteration_dir(root, iteration)
    vocab = (config.get("model") or {}).get("vocab_size")
    rel = f"{pair_dir(0, 0)}/model.pt"
    tensors = {}
    for name, t in state.items():
        is_vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        tensors[name] = {"shape": list(t.shape), "dim": None, "stride": 1, "tp": 1,
                         "vocab": vocab if is_vocab else None, "dtype": str(t.dtype),
                         "optim": False, "dirs": [pair_dir(0, 0)]}
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
    remove_debris(root, directory)
    return directory
