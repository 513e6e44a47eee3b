"""Reading a checkpoint's tensors: :class:`ShardReader` opens (and checks) the files of one
checkpoint directory and returns whole tensors, TP pieces or a rank's slices, range by range
(:mod:`megazero.checkpoint.ranged`); :func:`read_model_state` and
:func:`read_global_tensors` read a checkpoint as one process would, with no
``torch.distributed``. The format: :mod:`megazero.checkpoint`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megazero.checkpoint.files import verified_load, verify
from megazero.checkpoint.ranged import RangedPiece, as_tensor
from megazero.checkpoint.reader import DTYPES, MARKER, TRACKER, read_json, read_meta
from megazero.checkpoint.save_ranges import range_key
from megazero.checkpoint.tensors import ParamInfo, assemble, read_flat, read_slice
from megazero.errors import CheckpointError


class ShardReader:
    """Loads each file once (mmap, verified) and assembles global tensors from the index.

    ``bytes_read`` counts the bytes of saved tensors that :meth:`local` and :meth:`flat` took
    (the file pages a loading rank touches), so tests can check that a rank reads its own
    shard and not the model."""

    def __init__(self, directory: str, meta: dict[str, Any]) -> None:
        self.directory, self.meta, self.cache = directory, meta, {}
        self.bytes_read = 0

    def _tally(self, n: int) -> None:
        self.bytes_read += n

    def file(self, rel: str) -> Any:
        if rel not in self.cache:
            expected = self.meta["files"].get(rel)
            if expected is None:
                raise CheckpointError(f"{self.directory}/{MARKER} lists no checksum for {rel}")
            self.cache[rel] = verified_load(os.path.join(self.directory, rel), expected)
        return self.cache[rel]

    def json(self, rel: str) -> Any:
        """A JSON file of the checkpoint (``config.json``), checked against its checksum."""
        path = os.path.join(self.directory, rel)
        verify(path, self.meta["files"].get(rel))
        return read_json(path)

    def piece(self, name: str, kind: str, r: int) -> torch.Tensor | RangedPiece:
        """Saved TP piece ``r`` of ``kind``: a tensor (an entry with ``dirs``: the piece whole in
        its pair's file) or a :class:`RangedPiece` (an entry with ``ranges``, version 3)."""
        e = self.meta["tensors"][name]
        if "ranges" in e:
            return self._ranged(name, kind, r)
        d = e["dirs"][r]
        if kind == "weight":
            return self.file(f"{d}/model.pt")[name]
        return self.file(f"{d}/optim.pt")[name][kind]

    def _ranged(self, name: str, kind: str, r: int) -> RangedPiece:
        e = self.meta["tensors"][name]
        group = "weight" if kind == "weight" else "optim"
        ranges = e["ranges"][group][r]
        pos, numel, tiled = 0, math.prod(e["piece_shape"]), True
        for _, lo, hi in ranges:  # the index must tile the piece: in order, no gap, no overlap
            tiled = tiled and lo == pos and lo < hi
            pos = hi
        if not tiled or pos != numel:
            raise CheckpointError(
                f"{self.directory}/{MARKER}: the saved ranges of {name} ({group}, TP piece {r}) "
                f"do not cover its {numel} elements exactly once "
                f"({[(lo, hi) for _, lo, hi in ranges][:6]}); the index does not describe "
                f"this checkpoint's files: restore the metadata.json that was saved with them, "
                f"or load an earlier iteration")

        def loader(rel: str, lo: int, hi: int) -> Callable[[], torch.Tensor]:
            return lambda: self._range(rel, name, kind, lo, hi)

        dtype = DTYPES[e["dtype"]] if kind == "weight" else torch.float32
        return RangedPiece(e["piece_shape"], dtype,
                           [(lo, hi, loader(rel, lo, hi)) for rel, lo, hi in ranges])

    def _range(self, rel: str, name: str, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``name``'s ``kind`` as the index says ``rel`` holds them;
        a file that does not (an index edited or copied from another save, whose checksums
        still match) is one error naming the file, not a KeyError on every rank."""
        entry = self.file(rel)
        got = entry.get(range_key(name, lo)) if isinstance(entry, dict) else None
        values = got.get(kind) if isinstance(got, dict) else None
        if not isinstance(values, torch.Tensor) or values.numel() != hi - lo:
            raise CheckpointError(
                f"checkpoint file {os.path.join(self.directory, rel)} does not hold elements "
                f"[{lo}, {hi}) of {name} ({kind}) where {MARKER} says it does: the index and "
                f"the files do not match (an index edited, or copied from another save); "
                f"restore the metadata.json saved with these files, or load an earlier "
                f"iteration")
        return values

    def full(self, name: str, kind: str = "weight") -> torch.Tensor:
        e = self.meta["tensors"][name]
        if kind == "step":
            if "ranges" in e:
                rel, lo, _ = e["ranges"]["optim"][0][0]
                return self.file(rel)[range_key(name, lo)]["step"]
            return as_tensor(self.piece(name, kind, 0))
        return assemble(e, [as_tensor(self.piece(name, kind, r)) for r in range(e["tp"])])

    def local(self, name: str, kind: str, info: ParamInfo, local_shape: tuple[int, ...],
              tp_rank: int, tp_size: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's TP shard, copied ``into`` a tensor of its shape if given (else possibly
        a read-only view of the file: copy it)."""
        e = self.meta["tensors"][name]
        return read_slice(e, lambda r: self.piece(name, kind, r), info, local_shape, tp_rank,
                          tp_size, tally=self._tally, into=into)

    def flat(self, name: str, kind: str, info: ParamInfo, local_shape: tuple[int, ...],
             tp_rank: int, tp_size: int, lo: int, hi: int,
             into: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of this rank's flattened TP shard, copied ``into`` a 1-D
        tensor if given (else possibly a read-only view of the file: copy it)."""
        e = self.meta["tensors"][name]
        return read_flat(e, lambda r: self.piece(name, kind, r), info, local_shape, tp_rank,
                         tp_size, lo, hi, tally=self._tally, into=into)

    def files_of(self, name: str, kind: str) -> list[str]:
        """The files holding ``name``'s saved pieces of ``kind`` (weight, or optimizer state)."""
        e = self.meta["tensors"][name]
        if "ranges" in e:
            group = "weight" if kind == "weight" else "optim"
            return sorted({rel for piece in e["ranges"][group] for rel, _, _ in piece})
        rel = "model.pt" if kind == "weight" else "optim.pt"
        return sorted({f"{d}/{rel}" for d in e["dirs"]})


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
    config = ShardReader(directory, meta).json("config.json")
    has_masters = all(e.get("optim") for e in meta["tensors"].values())
    kind = "master" if has_masters and meta["tensors"] else "weight"
    state = read_global_tensors(root, iteration, (kind,))[kind]
    reader = ShardReader(directory, meta)  # the weight files are checked too, even when unused
    for rel in sorted({f for name in meta["tensors"] for f in reader.files_of(name, "weight")}):
        reader.file(rel)
    return config, {k: v.to(torch.float32) for k, v in state.items()}
