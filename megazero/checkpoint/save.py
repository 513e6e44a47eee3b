"""Saving a checkpoint: each rank writes the ranges it owns, every rank meets, then rank 0
writes the index and moves the tracker (the format: :mod:`megazero.checkpoint`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
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
from megazero.checkpoint.files import Writer, sha256
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
    remove_debris(root, directory)


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
    c = replica_coord(topo)
    directory = os.path.join(root, tag) if tag is not None else iteration_dir(root, iteration)
    engine = optimizer if is_engine(optimizer) else None
    if engine is not None:
        engine.wait_for_params()  # the weights are read below, outside any forward
    infos = [i for i in param_infos(list(models), c.pp, topo.pp_size) if not i.duplicate]
    shapes = local_shapes(infos, engine)
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
                                   rank_dir(c.tp, c.pp, c.dp), bucket_bytes, put,
                                   edp_rank=topo.edp_rank if topo.edp_group is not None
                                   else None)
        opaque = None if optimizer is None or engine is not None else optimizer.state_dict()
        put({"rng": get_rng_state(rng_tracker), "optimizer": opaque, "iteration": iteration,
             # 1-bit optimizers: this rank's error-feedback buffers (megazero.optim.onebit_state)
             "error_feedback": error_feedback_state(engine, infos)},
            f"{rank_dir(c.tp, c.pp, c.dp)}/optim_rng.pt")
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
