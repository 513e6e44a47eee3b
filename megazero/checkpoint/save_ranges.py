"""Saving the tensor ranges this rank owns, from where they live, one I/O bucket at a time.

The mirror of :mod:`megazero.checkpoint.restore`. A ZeRO rank owns contiguous ranges of each
parameter's flattened TP shard (its optimizer *pieces*): the fp32 masters and optimizer moments
of those ranges and, at stages 1-3, the model weights of the same ranges (at stage 3 they are
its parameter partition; at stages 1-2 every rank holds all weights, and each writes only its
own ranges, so the writes are spread over dp). Each range is copied from its home (a device
tensor, an offloaded host tensor, a slot the NVMe swapper streamed its sub-group into, a stage-3
parameter swap file) into a host buffer of at most ``bucket_bytes``; a full bucket becomes one
file (``mp_rank_TT_PPP_DDD/model_NNN.pt`` or ``optim_NNN.pt``) and is freed. So a save holds one
bucket beyond the training state, whatever the model size, and no collective ever sees a host
buffer: the only collective is the step count's MAX over dp, on a one-element device tensor.

Stage 0 and runs without the ZeRO engine hold everything on every dp rank: dp rank 0 writes it.
Parameters without optimizer pieces (frozen ones) are written whole by dp rank 0. Parameters
replicated over TP are written by TP rank 0 only, as in format version 2.

Every range is listed in the index as ``[file, lo, hi]`` per TP piece; :func:`merge_index` joins
the ranks' lists and checks that each TP piece is covered exactly once. Files hold
``{"<name>@<lo>": {"weight": t}}`` and ``{"<name>@<lo>": {"master": t, <state>: t, "step": s}}``
with 1-D tensors, so a loader reads any range from the pages of the files that hold it
(:mod:`megazero.checkpoint.ranged`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megazero.checkpoint.tensors import ParamInfo
from megazero.distributed.host_resident import host_empty, mark

DEFAULT_BUCKET_BYTES = 256 << 20  # one save file's tensors; the host memory a save adds
MIN_BUCKET_BYTES = 4 << 20


def bucket_for(state_bytes: int) -> int:
    """The I/O bucket for a rank that saves ``state_bytes``: a sixteenth of it, between
    :data:`MIN_BUCKET_BYTES` and :data:`DEFAULT_BUCKET_BYTES`. A bucket as large as the state
    would hold it all in host memory at once; an asynchronous save (which writes one file while
    the next is copied) then gains nothing from streaming."""
    return min(DEFAULT_BUCKET_BYTES, max(MIN_BUCKET_BYTES, state_bytes // 16))


def range_key(name: str, lo: int) -> str:
    return f"{name}@{lo}"


class BucketFiles:
    """Host copies of ranges, written as one file each time ``bucket_bytes`` would be passed.

    ``put(obj, rel)`` writes one file (atomically, recording its checksum); ``ranges[name]``
    lists ``[rel, lo, hi]`` for every range added."""

    def __init__(self, prefix: str, bucket_bytes: int, put: Callable[[Any, str], None]) -> None:
        self.prefix, self.bucket, self.put = prefix, max(1, bucket_bytes), put
        self.count, self.held = 0, 0
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.ranges: dict[str, list[list[Any]]] = {}

    def rel(self) -> str:
        return f"{self.prefix}_{self.count:03d}.pt"

    def chunk(self, bytes_per_element: int) -> int:
        """The most elements of one range that fit a bucket."""
        return max(1, self.bucket // max(1, bytes_per_element))

    def add(self, name: str, lo: int, n: int, nbytes: int,
            copy: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Range ``[lo, lo + n)`` of ``name``: ``copy()`` returns its values as 1-D host tensors
        (marked host buffers, kept until the file is written) plus 0-d scalars, ``nbytes`` in
        all. A full bucket is written before ``copy`` allocates, so at most one bucket is
        held."""
        if self.pending and self.held + nbytes > self.bucket:
            self.flush()
        self.pending[range_key(name, lo)] = copy()
        self.ranges.setdefault(name, []).append([self.rel(), lo, lo + n])
        self.held += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        self.put(self.pending, self.rel())
        self.pending, self.held = {}, 0
        self.count += 1


def to_host(src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A marked host copy of ``src`` (from the device, the host, or a swap slot)."""
    out = host_empty(src.numel(), dtype or src.dtype)
    out.copy_(src.reshape(-1))
    return out


def write_whole(files: BucketFiles, info: ParamInfo, values: torch.Tensor) -> None:
    """A tensor this rank holds entirely (``values``: its TP shard), in bucket-sized ranges."""
    flat = values.detach().reshape(-1)
    step = files.chunk(flat.element_size())
    for a in range(0, flat.numel(), step):
        b = min(flat.numel(), a + step)

        def copy(a: int = a, b: int = b) -> dict[str, torch.Tensor]:
            return {"weight": to_host(flat[a:b])}

        files.add(info.name, a, b - a, (b - a) * flat.element_size(), copy)


def write_piece_weights(files: BucketFiles, info: ParamInfo, pc: Any) -> None:
    """The model weights of one optimizer piece: its range of the parameter's flattened TP shard,
    read from the model's storage or, for a stage-3 shard swapped to NVMe, from its file."""
    n = pc.model.numel()
    step = files.chunk(pc.model.element_size())
    for a in range(0, n, step):
        b = min(n, a + step)

        def copy(a: int = a, b: int = b) -> dict[str, torch.Tensor]:
            if pc.swapped is not None:
                swap, start = pc.swapped
                return {"weight": mark(swap.read_range(start + a, b - a))}  # a fresh buffer
            return {"weight": to_host(pc.model[a:b])}

        files.add(info.name, pc.offset + a, b - a, (b - a) * pc.model.element_size(), copy)


def step_count(engine: Any, infos: list[ParamInfo]) -> float | None:
    """The optimizer's step count for the trainable parameters of ``infos``: the most any piece
    of this dp group took (a one-element MAX over dp on the engine's device at stages 1-3, where
    each rank holds only some pieces), or None for an optimizer that counts no steps.
    Collective over dp: called by every rank before any file is written, so a rank that fails
    to write cannot leave the others waiting in it."""
    import torch.distributed as dist

    masters = engine.masters
    if not masters.kind.has_step:
        return None
    keep = {id(i.param) for i in infos if i.param.requires_grad}
    step = 0.0
    for pc in masters.pieces:
        if id(pc.param) in keep:
            st = masters.optimizer.state.get(pc.master, {})
            if "step" in st:
                step = max(step, float(st["step"]))
    comm = engine.comms.dp
    if engine.zero.stage > 0 and comm.size > 1:
        t = torch.tensor([step], dtype=torch.float32, device=engine.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
        step = float(t.item())
    return step


def write_optimizer_ranges(files: BucketFiles, engine: Any, infos: dict[int, ParamInfo],
                           step: float | None) -> None:
    """fp32 master and optimizer state of every piece of ``infos`` this rank owns, from where
    they live (streamed sub-group by sub-group through the swapper's slots with NVMe offload);
    ``step``: the step count saved with each range (None: the optimizer counts none)."""
    masters = engine.masters
    names = masters.kind.state

    def visit(pc: Any, states: dict[str, torch.Tensor | None]) -> None:
        info = infos.get(id(pc.param))
        if info is None:
            return
        n = pc.model.numel()
        width = 4 * (1 + len(names))
        for a in range(0, n, files.chunk(width)):
            b = min(n, a + files.chunk(width))

            def copy(a: int = a, b: int = b) -> dict[str, torch.Tensor]:
                master = states["master"]
                assert master is not None
                out = {"master": to_host(master.detach().reshape(-1)[a:b], torch.float32)}
                for name in names:  # absent before the first step: zeros, as torch starts
                    t = states.get(name)
                    out[name] = (to_host(t.reshape(-1)[a:b], torch.float32) if t is not None
                                 else host_empty(b - a, torch.float32).zero_())
                if step is not None:
                    out["step"] = torch.tensor(step, dtype=torch.float32)
                return out

            files.add(info.name, pc.offset + a, b - a, (b - a) * width, copy)

    masters.stream_states(visit)


def merge_index(gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """One index entry per tensor from every rank's entries: ``ranges[kind][tp piece]`` the
    sorted ``[file, lo, hi]`` of all ranks, checked to cover each piece exactly once."""
    tensors: dict[str, Any] = {}
    for idx in gathered:
        for name, e in idx.items():
            t = tensors.setdefault(name, {k: v for k, v in e.items()
                                          if k not in ("tp_rank", "dir", "ranges")})
            if "dir" in e:  # format version 2: one whole TP piece per pair directory
                t.setdefault("dirs", [None] * e["tp"])[e["tp_rank"]] = e["dir"]
                continue
            rs = t.setdefault("ranges", {})
            for kind, lst in e["ranges"].items():
                rs.setdefault(kind, [[] for _ in range(e["tp"])])[e["tp_rank"]].extend(lst)
    for name, t in tensors.items():
        n = math.prod(t.get("piece_shape", []))
        for kind, pieces in t.get("ranges", {}).items():
            for r, lst in enumerate(pieces):
                lst.sort(key=lambda x: x[1])
                pos, tiled = 0, True  # each range starts where the previous one ended
                for _, lo, hi in lst:
                    tiled = tiled and lo == pos and lo < hi
                    pos = hi
                if pos != n or not tiled:
                    raise RuntimeError(
                        f"the saved ranges of {name} ({kind}, TP piece {r}) do not cover its "
                        f"{n} elements exactly once: {[(lo, hi) for _, lo, hi in lst][:8]}")
    return tensors


def write_rank_tensors(infos: list[ParamInfo], shapes: dict[int, torch.Size], engine: Any,
                       step: float | None, tp_rank: int, tp_size: int, dp_rank: int,
                       rank_dir: str, bucket_bytes: int, put: Callable[[Any, str], None],
                       edp_rank: int | None = None) -> dict[str, Any]:
    """Write this rank's ranges of weights and optimizer state under ``rank_dir`` (``step``:
    from :func:`step_count`); returns its index entries: one per tensor it wrote a range of
    (dp rank 0 lists every tensor it saves, with or without ranges, so tensors of no elements
    are indexed too).

    MoE experts (``param.expert``) are not replicated over TP but over their
    expert-data-parallel group: every TP rank holds its own experts, and the first rank of
    each expert's ``edp`` group (``edp_rank``) plays dp rank 0's part for it. An expert split
    by expert tensor parallelism is indexed as pieces of its own group (``ParamInfo.shard``),
    and fc2's bias, whole on every rank of that group, is saved by its rank 0."""
    edp_rank = dp_rank if edp_rank is None else edp_rank

    def first_replica(i: ParamInfo) -> bool:
        return (edp_rank if getattr(i.param, "expert", False) else dp_rank) == 0

    mine = [i for i in infos if i.dim is not None or tp_rank == 0
            or getattr(i.param, "expert", False)]
    # a tensor the expert-tensor-parallel ranks hold whole is saved by their rank 0
    mine = [i for i in mine if not getattr(i.param, "expert_tp_duplicate", False)]
    trainable = {id(i.param): i for i in mine if i.param.requires_grad}
    by_pieces = engine is not None and engine.zero.stage > 0
    weights = BucketFiles(f"{rank_dir}/model", bucket_bytes, put)
    for i in mine:
        if first_replica(i) and not (by_pieces and id(i.param) in trainable):
            write_whole(weights, i, i.param)
    if by_pieces:
        for pc in engine.masters.pieces:
            if id(pc.param) in trainable:
                write_piece_weights(weights, trainable[id(pc.param)], pc)
    weights.flush()
    optim = None
    if engine is not None and (engine.zero.stage > 0 or dp_rank == 0 or edp_rank == 0):
        optim = BucketFiles(f"{rank_dir}/optim", bucket_bytes, put)
        first = trainable if engine.zero.stage > 0 else {
            k: i for k, i in trainable.items() if first_replica(i)}
        write_optimizer_ranges(optim, engine, first, step)
        optim.flush()
    index: dict[str, Any] = {}
    for i in mine:
        has_optim = engine is not None and i.param.requires_grad
        ranges = {"weight": weights.ranges.get(i.name, [])}
        if has_optim:
            ranges["optim"] = optim.ranges.get(i.name, []) if optim is not None else []
        if not first_replica(i) and not any(ranges.values()):
            continue
        local = tuple(shapes[id(i.param)])
        rank, size = i.shard or (tp_rank, tp_size)  # an expert's own split group, or TP
        index[i.name] = {
            "shape": i.global_shape(local, tp_size), "dim": i.dim, "stride": i.stride,
            "tp": size if i.dim is not None else 1, "vocab": i.vocab,
            "dtype": str(i.param.dtype), "optim": has_optim, "piece_shape": list(local),
            "tp_rank": rank if i.dim is not None else 0, "ranges": ranges}
    return index
