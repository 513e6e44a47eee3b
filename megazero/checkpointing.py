"""Save and load training state, atomically, in Megatron's directory layout.

::

    SAVE/latest_checkpointed_iteration.txt       "10": the newest complete checkpoint
    SAVE/iter_0000010/metadata.json              layout and iteration; written last = complete
    SAVE/iter_0000010/config.json                the run's configuration (human-readable)
    SAVE/iter_0000010/mp_rank_TT_PPP/model.pt    weights of one (tp, pp) shard, all its chunks,
                                                 plus iteration, consumed samples, scheduler
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/optim_rng.pt
                                                 each rank: its optimizer / ZeRO shard (loss
                                                 scaler included) and its RNG states

The model file is written by dp rank 0 of each (tp, pp) pair (dp replicas hold the same
weights), except with ZeRO-3, where parameters are partitioned and every dp rank writes its own
``model.pt`` into its ``mp_rank_TT_PPP_DDD`` directory.

Why this is crash-safe: every file is written under a temporary name and renamed (a rename is
atomic on POSIX), every rank then meets at a barrier, and only after it does rank 0 write
``metadata.json`` and then the ``latest`` pointer. A crash at any earlier point leaves the new
iteration directory without its marker and ``latest`` still naming the previous checkpoint,
which is untouched. Loading refuses a directory without the marker.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "metadata.json"
# Test hook: "N" (or "N@ITER": only when saving iteration ITER) makes this process exit after it
# has written N files of a checkpoint, as a crash in mid-save would.
FAULT_ENV = "MEGAZERO_SAVE_FAULT_AFTER_FILES"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""


@dataclass(frozen=True)
class LoadResult:
    iteration: int
    consumed_samples: int
    path: str


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _model_path(root: str, iteration: int, tp: int, pp: int, dp: int | None) -> str:
    name = f"mp_rank_{tp:02d}_{pp:03d}" + ("" if dp is None else f"_{dp:03d}")
    return os.path.join(iteration_dir(root, iteration), name, "model.pt")


def _optim_path(root: str, iteration: int, tp: int, pp: int, dp: int) -> str:
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp:02d}_{pp:03d}_{dp:03d}",
                        "optim_rng.pt")


class _Writer:
    """Atomic file writes, with the fault-injection hook tests use to crash mid-save."""

    def __init__(self, iteration: int) -> None:
        spec = os.environ.get(FAULT_ENV, "")
        limit, _, only = spec.partition("@")
        self.limit = int(limit) if limit and (not only or int(only) == iteration) else None
        self.written = 0

    def _commit(self, tmp: str, path: str) -> None:
        os.replace(tmp, path)
        self.written += 1
        if self.limit is not None and self.written >= self.limit:
            os._exit(17)  # simulate a crash (kill -9, node failure) with files half written

    def torch(self, obj: Any, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save(obj, tmp)
        self._commit(tmp, path)

    def text(self, text: str, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, path)


def get_rng_state(tracker: Any = None) -> dict[str, Any]:
    """Every random stream a step may draw from, so a resumed run draws the same numbers."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict[str, Any], tracker: Any = None) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and "tracker" in state:
        tracker.set_states(state["tracker"])


def layout_of(topo: Any, zero_stage: int) -> dict[str, Any]:
    return {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size,
            "vpp": topo.vpp_size or 1, "zero_stage": zero_stage}


def config_dict(config: Any) -> Any:
    """A dataclass config as plain JSON values (for config.json and experiment trackers)."""
    if is_dataclass(config):
        config = asdict(config)
    return json.loads(json.dumps(config, default=str))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str, iteration: int, topo: Any, *, models: Sequence[torch.nn.Module],
                    optimizer: Any, scheduler: Any, consumed_samples: int, config: Any,
                    zero_stage: int = 0, rng_tracker: Any = None,
                    barrier: Callable[[], None] = _barrier) -> str:
    """Collective: every rank calls it. Returns the iteration directory."""
    w = _Writer(iteration)
    c = topo.coord
    per_dp_model = zero_stage == 3
    common = {"iteration": iteration, "consumed_samples": consumed_samples,
              "scheduler": scheduler.state_dict() if scheduler is not None else None,
              "layout": layout_of(topo, zero_stage)}
    if per_dp_model or c.dp == 0:
        model = {f"model{i}": m.state_dict() for i, m in enumerate(models)}
        w.torch({**common, "model": model},
                _model_path(root, iteration, c.tp, c.pp, c.dp if per_dp_model else None))
    w.torch({"optimizer": optimizer.state_dict() if optimizer is not None else None,
             "rng": get_rng_state(rng_tracker), "iteration": iteration},
            _optim_path(root, iteration, c.tp, c.pp, c.dp))
    barrier()  # every shard is on disk before the checkpoint is declared complete
    directory = iteration_dir(root, iteration)
    if topo.rank == 0:
        w.text(json.dumps(config_dict(config), indent=1), os.path.join(directory, "config.json"))
        meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                "layout": layout_of(topo, zero_stage), "world_size": topo.world_size}
        w.text(json.dumps(meta, indent=1), os.path.join(directory, MARKER))
        w.text(str(iteration), os.path.join(root, TRACKER))
    barrier()
    return directory


def read_tracker(root: str) -> int | None:
    """The iteration ``latest`` names, or ``None`` when ``root`` has no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number") from None


def _describe(layout: dict[str, Any]) -> str:
    return (f"tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} vpp={layout['vpp']} "
            f"zero_stage={layout['zero_stage']}")


def _check_layout(saved: dict[str, Any], current: dict[str, Any], directory: str,
                  with_optimizer: bool) -> None:
    keys = ["tp", "pp", "vpp"]
    if with_optimizer or saved["zero_stage"] == 3 or current["zero_stage"] == 3:
        keys += ["dp", "zero_stage"]  # optimizer shards (and ZeRO-3 weights) are split by dp
    if any(saved[k] != current[k] for k in keys):
        raise CheckpointError(
            f"checkpoint {directory} was saved at layout {_describe(saved)}, but this run is "
            f"{_describe(current)}; loading at a different layout (resharding) is not supported "
            "yet: resume with the saved --tensor-model-parallel-size, "
            "--pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage, data-"
            "parallel size and ZeRO stage (or use --no-load-optim / --finetune when only dp "
            "differs)")


def _load(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete "
                              "or was saved at another layout")
    # Our own files hold numpy and python RNG states, which weights_only loading refuses.
    return torch.load(path, map_location="cpu", weights_only=False)


def load_checkpoint(root: str, topo: Any, *, models: Sequence[torch.nn.Module], optimizer: Any,
                    scheduler: Any, zero_stage: int = 0, rng_tracker: Any = None,
                    no_load_optim: bool = False, no_load_rng: bool = False,
                    finetune: bool = False, iteration: int | None = None) -> LoadResult | None:
    """Restore the newest complete checkpoint under ``root`` (or ``iteration``).

    Returns ``None`` when ``root`` holds no checkpoint (a fresh start, as in Megatron).
    ``finetune`` loads the weights only and restarts at iteration 0.
    """
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    directory = iteration_dir(root, iteration)
    marker = os.path.join(directory, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(f"{directory} has no {MARKER}: the save of iteration {iteration} "
                              "did not complete; point --load at a complete checkpoint")
    meta = json.loads(open(marker, encoding="utf-8").read())
    load_optim = not (no_load_optim or finetune)
    _check_layout(meta["layout"], layout_of(topo, zero_stage), directory, load_optim)
    c = topo.coord
    per_dp_model = zero_stage == 3
    state = _load(_model_path(root, iteration, c.tp, c.pp, c.dp if per_dp_model else None))
    if len(state["model"]) != len(models):
        raise CheckpointError(f"{directory} holds {len(state['model'])} model chunks per rank, "
                              f"this run builds {len(models)}")
    for i, m in enumerate(models):
        m.load_state_dict(state["model"][f"model{i}"])
    if finetune:
        return LoadResult(0, 0, directory)
    shard = None
    if load_optim or not no_load_rng:
        shard = _load(_optim_path(root, iteration, c.tp, c.pp, c.dp))
    if load_optim:
        if optimizer is not None and shard["optimizer"] is not None:
            optimizer.load_state_dict(shard["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
    if not no_load_rng:
        set_rng_state(shard["rng"], rng_tracker)
    return LoadResult(int(state["iteration"]), int(state["consumed_samples"]), directory)
