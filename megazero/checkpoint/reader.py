"""Reading a portable checkpoint: the ``latest`` tracker, ``metadata.json``, and global
tensors or this rank's slices of them (see :mod:`megazero.checkpoint` for the format)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import torch

from megazero.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
TAG_TRACKER = "latest"  # names the newest tagged checkpoint (DeepSpeed's layout)
MARKER = "metadata.json"
FORMAT = "megazero-portable"
VERSION = 3  # 3: a TP piece may be saved as flat ranges in the files of its owners
MIN_VERSION = 2  # the oldest version this reader loads (2: one whole TP piece per pair file)
DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
_ITER_DIR = re.compile(r"iter_(\d{7,})")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


IMPORT_HINT = ("megazero reads only its own portable format: export the weights to Hugging Face "
               "format with the tool that wrote them, then import them with "
               "`python tools/checkpoint/convert.py --loader hf --saver megazero` and load the "
               "result with --finetune")


def _megatron_files(directory: str) -> str | None:
    """A file of a Megatron-LM (or Megatron-DeepSpeed) checkpoint in ``directory``, if any."""
    if not os.path.isdir(directory):
        return None
    for name in sorted(os.listdir(directory)):
        sub = os.path.join(directory, name)
        if name.startswith("mp_rank_") and os.path.isdir(sub):
            for f in ("model_optim_rng.pt", "model_rng.pt"):
                if os.path.isfile(os.path.join(sub, f)):
                    return os.path.join(sub, f)
        if name in ("common.pt", ".metadata") or name.endswith("_model_states.pt"):
            return sub  # Megatron distributed checkpoint / DeepSpeed layer files
    return None


def _foreign(root: str) -> None:
    """``root`` has no megazero tracker: refuse a checkpoint another tool wrote there rather
    than starting from random weights as if ``--load`` were empty."""
    latest = os.path.join(root, "latest")
    if os.path.isfile(latest):
        raise CheckpointError(f"{latest} is a DeepSpeed checkpoint tag (no {TRACKER} beside it): "
                              f"{IMPORT_HINT}")
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            if name.startswith("global_step") or name == "release":
                found = _megatron_files(os.path.join(root, name))
                if found:
                    raise CheckpointError(f"{found} belongs to a Megatron-LM/DeepSpeed checkpoint, "
                                          f"not a megazero one: {IMPORT_HINT}")


def complete_iterations(root: str) -> list[int]:
    """Iterations under ``root`` whose save completed (``iter_NNNNNNN/metadata.json``)."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        m = _ITER_DIR.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, MARKER)):
            out.append(int(m.group(1)))
    return sorted(out)


def _instead(root: str, named: int | None = None) -> str:
    """What to write into the tracker instead: the newest complete checkpoint, if any."""
    done = [i for i in complete_iterations(root) if i != named]
    if not done:
        return f"{root} holds no complete checkpoint; point --load elsewhere or drop it"
    return (f"the newest complete checkpoint is iteration {done[-1]}: write {done[-1]} into "
            f"{os.path.join(root, TRACKER)} to resume from it")


def read_tracker(root: str) -> int | None:
    """The iteration ``latest`` names, or ``None`` when ``root`` has no checkpoint.

    The tracker is authoritative, as in Megatron-LM and DeepSpeed: it may name an older
    checkpoint than the newest on disk (that is how a run is rolled back), and a tracker that
    cannot be used is an error naming the newest complete checkpoint, never a silent fallback
    to another iteration than the one the user (or the last save) chose. A missing tracker
    means "no checkpoint" only when no save ever completed; beside complete checkpoints it
    was deleted or lost, and starting from scratch would overwrite them."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        _foreign(root)
        done = complete_iterations(root)
        if done:
            raise CheckpointError(f"{root} has no {TRACKER}, but holds complete checkpoints; "
                                  f"{_instead(root)} (or point --load at an empty directory "
                                  f"to start from scratch)")
        return None
    try:
        text = open(path, encoding="utf-8").read().strip()
    except (OSError, ValueError) as e:  # unreadable, or not UTF-8 text
        text = repr(e)
    if text == "release":
        release = os.path.join(root, "release")
        found = _megatron_files(release)
        if found or not os.path.isdir(iteration_dir(root, 0)):
            raise CheckpointError(f"{path} names Megatron's 'release' directory ({found or release}"
                                  f"), not a megazero checkpoint: {IMPORT_HINT}")
        return 0
    if not text.isdigit() or not text.isascii():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number (damaged, "
                              f"or written by hand); {_instead(root)}")
    return int(text)


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e}); it is truncated "
                              "or corrupted: load an earlier iteration") from None


def check_format(marker: str, meta: Any) -> None:
    """Refuse, in one line naming ``marker``, any index this version cannot read whole: the
    old per-layout format (no ``format`` key), another program's, or another format version.
    Nothing is read before this check passes, so nothing is half-loaded."""
    if not isinstance(meta, dict) or "format" not in meta:
        raise CheckpointError(f"{marker} describes megazero's old per-layout format (format "
                              "version 1), which needs unsafe pickle loading; load it with the "
                              "megazero version that wrote it and save it again with this one, or "
                              "start from a portable checkpoint")
    if meta["format"] != FORMAT:
        raise CheckpointError(f"{marker} is in format {meta['format']!r}, not {FORMAT!r}: "
                              f"{IMPORT_HINT}")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{marker} has format version {version!r}, not an integer: the "
                              "index is damaged; load an earlier iteration")
    if version > VERSION:
        raise CheckpointError(f"{marker} has format version {version}, newer than the version "
                              f"this megazero reads ({VERSION}); load it with a newer megazero "
                              "(or have that one export it with tools/checkpoint/convert.py "
                              "--saver torch)")
    if version < MIN_VERSION:
        raise CheckpointError(f"{marker} has format version {version}, older than the versions "
                              f"this megazero reads ({MIN_VERSION}-{VERSION}); load it with the "
                              "megazero version that wrote it and save it again with this one")


def _refuse_megatron(directory: str) -> None:
    found = _megatron_files(directory)
    if found:
        raise CheckpointError(f"{found} belongs to a Megatron-LM checkpoint ({directory} has "
                              f"no {MARKER}): {IMPORT_HINT}")


def refuse_foreign(root: str) -> None:
    """The checks of :func:`read_meta` that need no complete checkpoint: a directory another
    tool wrote, or an index of another format or version (run before the process group)."""
    iteration = read_tracker(root)
    if iteration is None:
        return
    directory = iteration_dir(root, iteration)
    marker = os.path.join(directory, MARKER)
    if os.path.isfile(marker):
        check_format(marker, read_json(marker))
        return
    _refuse_megatron(directory)


def read_meta(root: str, iteration: int | None) -> tuple[int, str, dict[str, Any]] | None:
    named = iteration is None  # chosen by the tracker, not by the caller
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    directory = iteration_dir(root, iteration)
    where = f"{os.path.join(root, TRACKER)} names iteration {iteration}, but " if named else ""
    hint = f"; {_instead(root, iteration)}" if named else ("; point --load at a complete "
                                                          "checkpoint")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{where}{directory} does not exist{hint}")
    return iteration, directory, read_meta_at(directory, f"iteration {iteration}", where, hint)


def read_meta_at(directory: str, what: str, where: str = "",
                 hint: str = "; point --load at a complete checkpoint") -> dict[str, Any]:
    """``metadata.json`` of one checkpoint directory, checked (``what`` names the save in
    errors; ``where`` and ``hint`` say who named the directory and what to do instead)."""
    marker = os.path.join(directory, MARKER)
    if not os.path.isfile(marker):
        _refuse_megatron(directory)
        raise CheckpointError(f"{where}{directory} has no {MARKER}: the save of {what} did not "
                              f"complete{hint}")
    meta = read_json(marker)
    check_format(marker, meta)
    check_meta_digest(meta, marker)
    return meta


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of ``metadata.json``'s content without its own ``sha256`` entry, as written
    (``json.dumps(indent=1)``; ``json.load`` keeps the key order, so it re-serialises to the
    same text)."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, indent=1).encode("utf-8")).hexdigest()


def check_meta_digest(meta: dict[str, Any], path: str) -> None:
    """A bit flipped in ``metadata.json`` that leaves valid JSON (a digit of a size, a consumed
    sample count) is caught by its own checksum (absent in older saves: not checked)."""
    if "sha256" in meta and meta["sha256"] != meta_digest(meta):
        raise CheckpointError(f"checkpoint file {path} fails its SHA-256 check (corrupted); "
                              "copy it again or load an earlier iteration")
