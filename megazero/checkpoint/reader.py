"""Reading a portable checkpoint: the ``latest`` tracker, ``metadata.json``, and global
tensors or this rank's slices of them (see :mod:`megazero.checkpointing` for the format)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from megazero.checkpoint.files import CheckpointError, verified_load
from megazero.checkpoint.tensors import ParamInfo, assemble, read_slice

TRACKER = "latest_checkpointed_iteration.txt"
TAG_TRACKER = "latest"  # names the newest tagged checkpoint (DeepSpeed's layout)
MARKER = "metadata.json"
FORMAT = "megazero-portable"
VERSION = 2


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


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


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e}); it is truncated "
                              "or corrupted: load an earlier iteration") from None


def read_meta(root: str, iteration: int | None) -> tuple[int, str, dict[str, Any]] | None:
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    directory = iteration_dir(root, iteration)
    return iteration, directory, read_meta_at(directory, f"iteration {iteration}")


def read_meta_at(directory: str, what: str) -> dict[str, Any]:
    """``metadata.json`` of one checkpoint directory (``what`` names it in errors)."""
    marker = os.path.join(directory, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(f"{directory} has no {MARKER}: the save of {what} did not "
                              "complete; point --load at a complete checkpoint")
    meta = read_json(marker)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is in megazero's old per-layout format, which needs "
                              "unsafe pickle loading; re-save it with the megazero version that "
                              "wrote it, or start from a portable checkpoint")
    return meta


class ShardReader:
    """Loads each file once (mmap, verified) and assembles global tensors from the index."""

    def __init__(self, directory: str, meta: dict[str, Any]) -> None:
        self.directory, self.meta, self.cache = directory, meta, {}

    def file(self, rel: str) -> Any:
        if rel not in self.cache:
            expected = self.meta["files"].get(rel)
            if expected is None:
                raise CheckpointError(f"{self.directory}/{MARKER} lists no checksum for {rel}")
            self.cache[rel] = verified_load(os.path.join(self.directory, rel), expected)
        return self.cache[rel]

    def piece(self, name: str, kind: str, r: int) -> torch.Tensor:
        d = self.meta["tensors"][name]["dirs"][r]
        if kind == "weight":
            return self.file(f"{d}/model.pt")[name]
        return self.file(f"{d}/optim.pt")[name][kind]

    def full(self, name: str, kind: str = "weight") -> torch.Tensor:
        e = self.meta["tensors"][name]
        if kind == "step":
            return self.piece(name, kind, 0)
        return assemble(e, [self.piece(name, kind, r) for r in range(e["tp"])])

    def local(self, name: str, kind: str, info: ParamInfo, local_shape: tuple[int, ...],
              tp_rank: int, tp_size: int) -> torch.Tensor:
        e = self.meta["tensors"][name]
        return read_slice(e, lambda r: self.piece(name, kind, r), info, local_shape, tp_rank,
                          tp_size)


def read_global_tensors(root: str, iteration: int | None = None,
                        kinds: Sequence[str] = ("weight",)) -> dict[str, dict[str, torch.Tensor]]:
    """``{kind: {global name: tensor}}`` for kinds among weight, master, exp_avg, exp_avg_sq
    (unpadded, tp=1), from a checkpoint of any layout; one process, no torch.distributed."""
    found = read_meta(root, iteration)
    if found is None:
        raise CheckpointError(f"{root} holds no checkpoint ({TRACKER} is missing)")
    _, directory, meta = found
    reader = ShardReader(directory, meta)
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in kinds}
    for name, e in meta["tensors"].items():
        for k in kinds:
            if k != "weight" and not e.get("optim"):
                raise CheckpointError(f"{directory} holds no optimizer state ({k}) for {name}")
            out[k][name] = reader.full(name, k).clone()
    return out


def read_model_state(root: str, iteration: int | None = None
                     ) -> tuple[dict, dict[str, torch.Tensor]]:
    """The saved run config (config.json) and the full global fp32 state dict (tp=1 names,
    unpadded vocabulary) of a checkpoint of any layout; one process, no torch.distributed.
    Where the fp32 masters were saved they are returned (exact in mixed precision)."""
    found = read_meta(root, iteration)
    if found is None:
        raise CheckpointError(f"{root} holds no checkpoint ({TRACKER} is missing)")
    iteration, directory, meta = found
    config = read_json(os.path.join(directory, "config.json"))
    has_masters = all(e.get("optim") for e in meta["tensors"].values())
    kind = "master" if has_masters and meta["tensors"] else "weight"
    state = read_global_tensors(root, iteration, (kind,))[kind]
    reader = ShardReader(directory, meta)  # the weight files are checked too, even when unused
    for d in sorted({d for e in meta["tensors"].values() for d in e["dirs"]}):
        reader.file(f"{d}/model.pt")
    return config, {k: v.to(torch.float32) for k, v in state.items()}
