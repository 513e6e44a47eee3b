"""A loading rank reads its own shard of the checkpoint, never the whole model.

Saved at tp2 (ZeRO-1, 2 ranks); loaded in the same world at the same layout, at tp1 x dp2
ZeRO-1, at tp1 x dp2 ZeRO-3 (every parameter partitioned) and the same with the partitions in
NVMe swap files. The reader counts the bytes of
saved tensors each rank takes from the files (``ShardReader.bytes_read``); the reference is what
the rank holds after loading, from the engine's own structures: its weights (whole parameters,
or at ZeRO-3 its partition of each unit) plus, for each optimizer piece, its master, exp_avg and
exp_avg_sq. The only excess allowed is the partial first and last rows of a flat range. The
loaded values are compared with :func:`read_global_tensors` (whole tensors, one process).
"""

from __future__ import annotations

import json
import os

import torch

from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY, train_in_rank

# vocab 256: no padding rows at tp 1 or tp 2, so every byte a rank holds comes from the file
MODEL = [*TINY, "--vocab-size", "256", "--hidden-size", "48"]
TP2 = ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]
KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")


def _held(engine):
    """(weight elements, optimizer-piece elements, largest row) this rank holds."""
    weights = 0
    for store in engine.stores:
        units = getattr(store, "units", None)
        if units is None:
            weights += sum(p.numel() for p in store.params())
        else:  # stage 3: the rank's range of each unit, padding left out
            weights += sum(min(u.own_hi, u.numel) - min(u.own_lo, u.numel) for u in units)
    pieces = engine.masters.pieces
    return weights, sum(pc.model.numel() for pc in pieces), len(pieces)


def _check_values(run, tmp, rank, optimizer=True):
    """Weights (and optimizer ranges) equal the whole saved tensors' elements (tp 1 runs)."""
    from megazero.checkpoint import read_global_tensors
    from megazero.checkpoint.tensors import param_infos

    glob = read_global_tensors(f"{tmp}/a", kinds=KINDS)
    names = {id(i.param): i.name for i in param_infos(run.chunks, 0, 1)}
    for store in run.engine.stores:
        for u in getattr(store, "units", []):
            for p, s in zip(u.params, u.starts):
                flat = glob["weight"][names[id(p)]].reshape(-1)
                lo, hi = max(s, u.own_lo), min(s + flat.numel(), u.own_hi)
                shard = u.shard if u.swap is None else u.swap.read_range(0, u.shard_size)
                if lo < hi:
                    got = shard[lo - u.own_lo:hi - u.own_lo]
                    assert torch.equal(got, flat[lo - s:hi - s]), (rank, names[id(p)])
        if not hasattr(store, "units"):
            for p in store.params():
                assert torch.equal(p.detach(), glob["weight"][names[id(p)]]), names[id(p)]
    if not optimizer:
        return
    opt = run.engine.masters.optimizer
    for pc in run.engine.masters.pieces:
        n, name = pc.model.numel(), names[id(pc.param)]
        for kind, got in (("master", pc.master), ("exp_avg", opt.state[pc.master]["exp_avg"]),
                          ("exp_avg_sq", opt.state[pc.master]["exp_avg_sq"])):
            want = glob[kind][name].reshape(-1)[pc.offset:pc.offset + n]
            assert torch.equal(got, want), (rank, kind, name)


def _rank(rank, world, tmp, ds3, nvme):
    import megazero.checkpoint.load as ckpt
    from megazero.config import load_config
    from megazero.training.lifecycle import setup

    # two steps: the first runs at learning rate 0 (warmup), so it leaves the weights as built
    train_in_rank(rank, world, [*MODEL, *TP2, "--train-iters", "2", "--save", f"{tmp}/a"])
    readers = []

    class Counting(ckpt.ShardReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    ckpt.ShardReader = Counting
    out = {}
    for name, layout in (("tp2 zero1 (same)", TP2), ("tp1 dp2 zero1", ["--zero-stage", "1"]),
                         ("tp1 dp2 zero3", ["--deepspeed_config", ds3]),
                         ("tp1 dp2 zero3 nvme", ["--deepspeed_config", nvme])):
        run = setup(load_config([*MODEL, *layout, "--train-iters", "1"], world))
        run.monitor.close()
        load = dict(models=run.chunks, optimizer=run.engine, scheduler=run.scheduler,
                    zero_stage=run.cfg.zero.stage)
        if run.topo.tp_size == 1:  # weights alone first: the optimizer load rewrites them
            ckpt.load_checkpoint(f"{tmp}/a", run.topo, finetune=True, **load)
            _check_values(run, tmp, rank, optimizer=False)
        readers.clear()
        ckpt.load_checkpoint(f"{tmp}/a", run.topo, **load)
        if run.topo.tp_size == 1:
            _check_values(run, tmp, rank)
        out[name] = (readers[0].bytes_read, *_held(run.engine), 48 * 4)
    return out


def test_each_rank_reads_only_its_shard(tmp_path):
    tmp = str(tmp_path)
    zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "swap"), "buffer_size": 100000,
            "max_in_cpu": 0}
    os.makedirs(nvme["nvme_path"])
    paths = []
    for name, zero in (("ds3", zero3), ("nvme", dict(zero3, offload_param=nvme))):
        paths.append(os.path.join(tmp, f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                       "zero_optimization": zero}, f)
    results = run_distributed(_rank, 2, tmp, *paths, timeout=300)
    for rank, out in enumerate(results):
        for name, (read, weights, optim, pieces, row_bytes) in out.items():
            held = 4 * (weights + 3 * optim)  # fp32 files: weights, master, exp_avg, exp_avg_sq
            # partial rows: at most one row at each end of each (weight or state) flat range
            slack = 2 * row_bytes * (pieces * 3 + (pieces if "zero3" in name else 0))
            print(name, rank, read, held, slack)
            assert held <= read <= held + slack, (name, rank, read, held, slack)
