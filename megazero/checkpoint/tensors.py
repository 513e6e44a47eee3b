"""What each saved tensor is globally, and how a rank cuts its slice out of the saved pieces.

A parameter's *global name* is its key in the state dict of the model built at tp=1, pp=1,
vpp=1. :class:`GPTModel` chunks already name decoder layers by global index, so a chunk's own
keys are global names; the one exception is the last stage's copy of a tied word embedding
(``output_layer.weight`` with ``shared_embedding``), which is the same tensor as
``embedding.word_embeddings.weight``: it is not saved twice and is loaded from that name.
Modules that are not GPT chunks keep their keys under ``model<i>.`` (plus ``pp<r>.`` when
pp > 1), which is only layout-independent for the TP axis.

A saved piece is one TP shard of one tensor as the saving rank held it, vocabulary padding
included. The index records the global (unpadded) shape, the split dim, the stride (SwiGLU's
fused fc1 holds its slice of both halves) and the TP size; :func:`assemble` rebuilds the global
tensor from the pieces (``unshard_tensor``), drops the padding rows, and
:func:`slice_for` cuts and re-pads the slice the loading rank holds. Reading goes through
``mmap`` loads, so a rank touches only the pages of the tensors it asks for; the largest
temporary is one global tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megazero.tensor_parallel.utils import shard_tensor, unshard_tensor

WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class ParamInfo:
    """One parameter of this rank, with what the checkpoint needs to know about it."""

    name: str  # global name
    param: nn.Parameter
    chunk: int
    duplicate: bool  # a tied copy: loaded, never saved
    dim: int | None  # TP split dim, None when replicated over TP
    stride: int
    vocab: int | None  # unpadded rows, for vocabulary-parallel tensors

    def global_shape(self, local_shape: tuple[int, ...], tp: int) -> list[int]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= tp
        if self.vocab is not None:
            shape[0] = self.vocab
        return shape


def param_infos(models: list[nn.Module], pp_rank: int, pp_size: int) -> list[ParamInfo]:
    out = []
    for i, m in enumerate(models):
        gpt = hasattr(m, "layer_range")
        for key, p in m.named_parameters():
            dup = gpt and key == "output_layer.weight" and getattr(p, "shared_embedding", False)
            if gpt:
                name = WORD_EMBEDDING if dup else key
            else:
                name = (f"pp{pp_rank}." if pp_size > 1 else "") + f"model{i}.{key}"
            tp_split = getattr(p, "tensor_model_parallel", False)
            out.append(ParamInfo(name, p, i, dup, p.partition_dim if tp_split else None,
                                 getattr(p, "partition_stride", 1) if tp_split else 1,
                                 getattr(p, "vocab_size", None)))
    return out


def assemble(entry: dict[str, Any], pieces: list[torch.Tensor]) -> torch.Tensor:
    """The global (tp=1, unpadded) tensor from its saved TP pieces in TP-rank order."""
    full = (pieces[0] if entry["dim"] is None
            else unshard_tensor(list(pieces), entry["dim"], entry["stride"]))
    if entry.get("vocab") is not None:
        full = full.narrow(0, 0, entry["shape"][0])
    return full


def slice_for(full: torch.Tensor, info: ParamInfo, local_shape: tuple[int, ...], tp_rank: int,
              tp_size: int) -> torch.Tensor:
    """This rank's TP shard of a global tensor, vocabulary rows re-padded with zeros."""
    if info.vocab is not None:
        rows = local_shape[0] * (tp_size if info.dim == 0 else 1)
        if rows > full.shape[0]:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    if info.dim is not None:
        full = shard_tensor(full, info.dim, info.stride, tp_rank, tp_size)
    return full.contiguous()


def read_slice(entry: dict[str, Any], piece: Any, info: ParamInfo,
               local_shape: tuple[int, ...], tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's TP shard, reading only the saved pieces that overlap it.

    ``piece(r)`` returns saved TP piece ``r`` (an mmap-backed tensor: only the rows taken are
    read from disk). Along the split dim, with stride k, the global tensor is k blocks; saved
    piece r holds rows ``[r*n', (r+1)*n')`` of each block and this rank needs
    ``[t*n, (t+1)*n)``. Vocabulary padding sits after the real rows (at the end of the single
    block), so rows at or beyond the real vocabulary are zeros, whatever either side padded to.
    Replicated tensors and a split dim that differs from the saved one fall back to
    :func:`assemble` + :func:`slice_for`.
    """
    dim, k = info.dim, info.stride
    if dim is None or entry["dim"] != dim or entry["stride"] != k:
        if entry["dim"] is None and dim is None:
            return piece(0).clone()
        full = assemble(entry, [piece(r) for r in range(entry["tp"])])
        return slice_for(full, info, local_shape, tp_rank, tp_size)
    saved_tp = entry["tp"]
    first = piece(0)
    n_saved = first.shape[dim] // k  # rows per block in a saved piece
    n_mine = local_shape[dim] // k
    real = entry["shape"][0] if info.vocab is not None else None
    out = torch.zeros(local_shape, dtype=first.dtype)
    for b in range(k):
        lo, hi = tp_rank * n_mine, (tp_rank + 1) * n_mine  # rows of block b this rank holds
        if real is not None:
            hi_real = min(hi, real)
        else:
            hi_real = hi
        r = lo // n_saved if n_saved else 0
        pos = lo
        while pos < hi_real and r < saved_tp:
            p_lo, p_hi = r * n_saved, (r + 1) * n_saved
            a, z = max(pos, p_lo), min(hi_real, p_hi)
            if a < z:
                src = piece(r).narrow(dim, b * n_saved + a - p_lo, z - a)
                out.narrow(dim, b * n_mine + a - lo, z - a).copy_(src)
                pos = z
            r += 1
    return out


def optimizer_state_per_param(engine: Any, infos: list[ParamInfo],
                              shapes: dict[int, torch.Size]) -> dict[int, dict[str, Any]]:
    """fp32 master, optimizer state (the kind's names: Adam's ``exp_avg``/``exp_avg_sq`` and
    ``step``, SGD's ``momentum_buffer``) of every parameter this rank holds, each as a full TP
    shard in the parameter's shape.

    Why gather at save instead of storing ZeRO's flat ranges: the ranges depend on the bucket
    sizes, dp size and ZeRO stage, so a reader at another layout would need the saving run's
    bucketing to make sense of them. Each dp rank fills the ranges it owns into zero tensors and
    one all-reduce (sum) over dp completes them (x + 0 is exact); stage 0 owns everything
    already. The cost is a transient (1 + state tensors) x fp32 copy of the TP shard per rank
    during the save.
    """
    import torch.distributed as dist

    stage, comm = engine.zero.stage, engine.comms.dp
    masters = engine.masters
    names = masters.kind.state
    rows = 1 + len(names)
    keep = {id(i.param) for i in infos}
    bufs: dict[int, torch.Tensor] = {}
    cover: dict[int, torch.Tensor] = {}
    step = 0.0
    with masters.resident():  # NVMe offload: masters and moments read from the swap files
        for pc in masters.pieces:
            pid = id(pc.param)
            if pid not in keep:
                continue
            n = shapes[pid].numel()
            if pid not in bufs:
                bufs[pid] = torch.zeros(rows, n, dtype=torch.float32, device=pc.master.device)
                cover[pid] = torch.zeros(n, dtype=torch.float32, device=pc.master.device)
            lo, hi = pc.offset, pc.offset + pc.model.numel()
            bufs[pid][0, lo:hi] = pc.master.detach().float()
            st = masters.optimizer.state.get(pc.master, {})
            for r, name in enumerate(names, 1):  # absent before the first step: zeros
                if st.get(name) is not None:
                    bufs[pid][r, lo:hi] = st[name].reshape(-1)
            if "step" in st:
                step = max(step, float(st["step"]))
            cover[pid][lo:hi] += 1
    order = [id(i.param) for i in infos]
    for pid in order:  # parameters with no piece on this rank contribute zeros
        if pid not in bufs:
            bufs[pid] = torch.zeros(rows, shapes[pid].numel(), dtype=torch.float32)
            cover[pid] = torch.zeros(shapes[pid].numel(), dtype=torch.float32)
    if stage > 0 and comm.size > 1 and order:
        device = next(iter(bufs.values())).device
        flat = torch.cat([torch.cat([bufs[p].reshape(-1).to(device), cover[p].to(device)])
                          for p in order] + [torch.tensor([step], device=device)])
        dist.all_reduce(flat, group=comm.group)
        pos = 0
        for p in order:
            n = shapes[p].numel()
            bufs[p] = flat[pos:pos + rows * n].view(rows, n)
            cover[p] = flat[pos + rows * n:pos + (rows + 1) * n]
            pos += (rows + 1) * n
        step_t = torch.tensor([step], device=device)
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX, group=comm.group)
        step = float(step_t.item())
    out = {}
    for p in order:
        if not bool((cover[p] == 1).all()):
            raise RuntimeError(f"ZeRO pieces cover a parameter of shape {tuple(shapes[p])} "
                               f"{int(cover[p].min())}..{int(cover[p].max())} times, not once")
        shape = shapes[p]
        b = bufs[p].cpu()
        out[p] = {"master": b[0].view(shape).clone(),
                  **{name: b[r].view(shape).clone() for r, name in enumerate(names, 1)}}
        if masters.kind.has_step:
            out[p]["step"] = torch.tensor(step, dtype=torch.float32)
    return out
