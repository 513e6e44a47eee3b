"""Format version 2's checkpoint writer, kept as a test reference for the streaming save.

Until format version 3 a save assembled every parameter's fp32 master and optimizer moments as
full TP shards on every dp rank (each rank filled the ranges it owns into zero tensors and one
all-reduce over dp summed them; stage 3 gathered the whole model first), and dp rank 0 of each
(tp, pp) pair wrote them whole to ``mp_rank_TT_PPP/model.pt`` and ``optim.pt``. That costs a
transient (1 + states) x fp32 copy of the TP shard per rank and reduces host tensors over dp
(refused by NCCL when the optimizer is offloaded), so the library no longer does it; the tests
keep it to check that the streaming writer saves the same tensors (a golden comparison) and
that a version-2 checkpoint still loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from megazero.checkpoint.common import (
    gather_all as _gather,
)
from megazero.checkpoint.common import (
    pair_dir as _pair_dir,
)
from megazero.checkpoint.common import (
    rank_dir as _rank_dir,
)
from megazero.checkpoint.files import Writer, sha256
from megazero.checkpoint.rng import get_rng_state
from megazero.checkpoint.save import _write_index, run_state
from megazero.checkpoint.tensors import ParamInfo, param_infos
from megazero.distributed.host_resident import is_host_resident, mark


def save_v2(root: str, topo: Any, *, models: Sequence[torch.nn.Module], engine: Any,
            config: Any, zero_stage: int, tag: str, extra_state: Any = None) -> str:
    """Collective: what ``save_checkpoint`` wrote in format version 2 (ZeRO engine only)."""
    import torch.distributed as dist

    w = Writer()
    c = topo.coord
    directory = os.path.join(root, tag)
    infos = [i for i in param_infos(list(models), c.pp, topo.pp_size) if not i.duplicate]
    if engine.zero.stage == 3:
        full = engine.full_parameters()
        weights = {id(i.param): full.get(id(i.param), i.param.detach()) for i in infos}
    else:
        weights = {id(i.param): i.param.detach() for i in infos}
    shapes = {k: v.shape for k, v in weights.items()}
    optim = optimizer_state_per_param(engine, [i for i in infos if i.param.requires_grad],
                                      shapes)
    mine = [i for i in infos if i.dim is not None or c.tp == 0]
    index: dict[str, Any] = {}
    files: dict[str, Any] = {}

    def put(obj: Any, rel: str) -> None:
        path = os.path.join(directory, rel)
        w.torch(obj, path)
        files[rel] = {"sha256": sha256(path), "bytes": os.path.getsize(path)}

    if c.dp == 0:
        pair = _pair_dir(c.tp, c.pp)
        put({i.name: weights[id(i.param)].clone() for i in mine}, f"{pair}/model.pt")
        put({i.name: optim[id(i.param)] for i in mine if id(i.param) in optim},
            f"{pair}/optim.pt")
        for i in mine:
            index[i.name] = {
                "shape": i.global_shape(tuple(shapes[id(i.param)]), topo.tp_size),
                "dim": i.dim, "stride": i.stride,
                "tp": topo.tp_size if i.dim is not None else 1,
                "vocab": i.vocab, "dtype": str(weights[id(i.param)].dtype),
                "tp_rank": c.tp if i.dim is not None else 0, "dir": pair,
                "optim": id(i.param) in optim}
    put({"rng": get_rng_state(None), "optimizer": None, "iteration": 0},
        f"{_rank_dir(c.tp, c.pp, c.dp)}/optim_rng.pt")
    if extra_state is not None and topo.rank == 0:
        put(extra_state, "extra_state.pt")
    dist.barrier()
    gathered = _gather((index, files, None, False))
    if topo.rank == 0:
        _write_index(w, root, directory, 0, gathered, config, 0, topo, zero_stage,
                     run_state(None, engine), True, tag, version=2)
    dist.barrier()
    return directory


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
    host = False
    with masters.resident():  # NVMe offload: masters and moments read from the swap files
        for pc in masters.pieces:
            pid = id(pc.param)
            if pid not in keep:
                continue
            n = shapes[pid].numel()
            if pid not in bufs:
                bufs[pid] = torch.zeros(rows, n, dtype=torch.float32, device=pc.master.device)
                cover[pid] = torch.zeros(n, dtype=torch.float32, device=pc.master.device)
                if is_host_resident(pc.master):  # host buffers, as the offloaded masters
                    host = True
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
        if host:  # what the host_resident rule asks of a host buffer kept on purpose
            mark(flat)
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
