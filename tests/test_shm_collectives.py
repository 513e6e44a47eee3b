"""The shared-memory collectives (:mod:`megazero.distributed.shm_collectives`): their results
against the backend's, how the ZeRO engine uses them at stages 0-2, and what happens when a group
cannot."""

import errno
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed import shm_collectives
from megazero.distributed.group_comm import CommLog, GroupComm
from megazero.distributed.shm_collectives import SharedOp, merge_ops
from megazero.distributed.topology import ParallelTopology
from megazero.errors import ConfigError
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, engine_train_step, make_batches
from megazero.zero import build_zero_optimizer


def _leftover_files(pids) -> list[str]:
    """The shared-memory files left by processes ``pids``."""
    prefixes = tuple(f"megazero-{pid}-" for pid in pids)
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefixes))


def _sums_world(rank, world_size):
    group = dist.group.WORLD
    comm = GroupComm(group, "dp", CommLog(), shared_memory="shared_memory")
    numel = 1002  # a multiple of 3: the last 6 elements are a reduce-scatter / all-gather range
    buf = comm.shared_buffer(numel, torch.float32, torch.device("cpu"))
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    mapped_files = _leftover_files(pids)  # every rank has unlinked its file
    assert comm.is_shared(buf) and torch.equal(buf, torch.zeros(numel))
    g = torch.Generator().manual_seed(rank)
    out = []
    # all-reduce ranges: averaged, summed, adjacent (merged), shorter than the group
    ranges = [(0, 300, True), (300, 301, False), (301, 302, False), (500, 993, True),
              (993, 996, False)]
    for _ in range(3):  # the buffer is reused: after a flush it is this rank's again
        buf.copy_(torch.randn(numel, generator=g))
        everyone = [torch.empty(numel) for _ in range(world_size)]
        dist.all_gather(everyone, buf.clone())
        total = torch.stack(everyone).sum(0)
        expect = buf.clone()
        for lo, hi, avg in ranges:
            expect[lo:hi] = total[lo:hi] / world_size if avg else total[lo:hi]
        handles = [comm.all_reduce(buf[lo:hi], async_op=True, average=avg)
                   for lo, hi, avg in ranges]
        rs = comm.reduce_scatter_in_place(buf[996:1002], async_op=True)
        expect[996 + 2 * rank:998 + 2 * rank] = total[996 + 2 * rank:998 + 2 * rank]
        before = comm.flushes
        handles[-1].wait()  # the first wait runs them all, once
        assert comm.flushes == before + 1 and all(h.ready() for h in [*handles, rs])
        rs.wait()
        assert comm.flushes == before + 1
        err = (buf - expect).abs().max().item()
        # all-gather: rank r's shard of [996, 1002) from rank r's buffer
        shards = buf[996:1002].clone()
        comm.all_gather_in_place(buf[996:1002])
        gathered = [torch.empty(6) for _ in range(world_size)]
        dist.all_gather(gathered, shards)
        want = torch.cat([gathered[k][2 * k:2 * k + 2] for k in range(world_size)])
        out.append((err, torch.equal(buf[996:1002], want)))
    return out, mapped_files, comm.is_shared(buf[10:20]), comm.is_shared(torch.zeros(3)), pids


def test_shared_memory_collectives_match_the_backends_and_leave_no_files():
    results = run_distributed(_sums_world, 3, timeout=120)
    for steps, files, inside, outside, _ in results:
        for err, gathered in steps:
            assert err < 1e-6, err  # three ranks: the sum order differs from gloo's
            assert gathered
        assert inside and not outside
        assert files == [], files  # unlinked once every rank had mapped them
    assert _leftover_files(results[0][4]) == []


def test_merge_ops_joins_neighbouring_all_reduces_only():
    ar = [SharedOp("all_reduce", 5, 9, True), SharedOp("all_reduce", 0, 5, True),
          SharedOp("all_reduce", 9, 12), SharedOp("all_reduce", 12, 20)]
    assert merge_ops(ar) == [SharedOp("all_reduce", 0, 9, True), SharedOp("all_reduce", 9, 20)]
    rs = [SharedOp("reduce_scatter", 0, 4), SharedOp("reduce_scatter", 4, 8)]
    assert merge_ops(rs) == rs  # merged, the shards would change owners


# name, ZeRO keys, shared_memory, micro-batches, the run it must equal, shared-memory passes per
# step (stage 0: the gradients' all-reduce; stage 1: their reduce-scatter, then the parameters'
# all-gather; stage 2: the all-gather, its gradients go through gloo)
ENGINE_CASES = [
    ("gloo 0", dict(stage=0, overlap_comm=True), "backend", 1, None, 0),
    ("shm 0", dict(stage=0, overlap_comm=True), "auto", 1, "gloo 0", 1),
    ("shm 0 no overlap", dict(stage=0, overlap_comm=False), "shared_memory", 1, "gloo 0", 1),
    ("shm 0 accumulation", dict(stage=0), "auto", 2, "gloo 0", 1),
    ("shm 0 copy mode", dict(stage=0, contiguous_gradients=False), "auto", 1, "gloo 0", 1),
    ("gloo 1", dict(stage=1, overlap_comm=True), "backend", 1, None, 0),
    ("shm 1", dict(stage=1, overlap_comm=True), "auto", 1, "gloo 1", 2),
    ("shm 1 copy mode", dict(stage=1, contiguous_gradients=False), "auto", 1, "gloo 1", 2),
    ("gloo 1 all-reduce", dict(stage=1, reduce_scatter=False), "backend", 1, None, 0),
    ("shm 1 all-reduce", dict(stage=1, reduce_scatter=False), "auto", 1, "gloo 1 all-reduce", 2),
    ("gloo 2", dict(stage=2, overlap_comm=True), "backend", 1, None, 0),
    ("shm 2", dict(stage=2, overlap_comm=True), "auto", 1, "gloo 2", 1),
]
STEPS = 4


def _engine_world(rank, world_size):
    topo = ParallelTopology.build()
    opt = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    batches = make_batches(STEPS, 8, 8, 64)
    rows = 8 // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    runs, out = {}, {}
    for name, zkw, impl, micro, ref, _ in ENGINE_CASES:
        model = TinyLM(vocab=64)
        engine = build_zero_optimizer([model], opt, ZeroConfig(reduce_bucket_size=300, **zkw),
                                      PrecisionConfig(), topo, shared_memory=impl)
        dp = engine.comms.dp
        shared = [dp.is_shared(t) for s in engine.stores for t in (s.grad_flat, s.param_flat)
                  if t is not None]
        losses, norms = [], []
        for tokens, labels in batches:
            loss, res = engine_train_step(model, engine, tokens[mine], labels[mine], micro)
            losses.append(loss)
            norms.append(res.grad_norm)
        runs[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        dw = (max((runs[name][k] - runs[ref][k]).abs().max().item() for k in runs[ref])
              if ref else 0.0)  # tensors stay in the rank: compare here
        out[name] = (shared, losses, norms, dw, dp.flushes)
    return out


def test_stages_0_to_2_through_shared_memory_equal_gloo_bit_for_bit():
    for runs in run_distributed(_engine_world, 2, timeout=300):
        for name, zkw, _, micro, ref, passes in ENGINE_CASES:
            shared, l2, n2, dw, flushes = runs[name]
            # (gradient buffer, parameter buffer) shared: stage 0 its gradients, 1 both, 2 its
            # parameters (stage 2 has no full gradient buffer)
            expect = {0: [True, False], 1: [True, True], 2: [True]}[zkw["stage"]]
            assert shared == (expect if ref else [False] * len(expect)), name
            # every bucket in one pass, also without overlap_comm: a bucket reduced where
            # backward finished it would wait there for the slowest rank
            assert flushes == passes * STEPS, (name, flushes)
            if ref is None:
                continue
            _, losses, norms, _, _ = runs[ref]
            if micro > 1:  # two micro-batches: another sum; compare with the 1-batch run
                assert max(abs(a - b) for a, b in zip(losses, l2)) < 1e-5, name
                assert dw < 1e-5, name
                continue
            # two ranks: a + b in either order, and /2 before or after the sum, are exact
            assert l2 == losses and n2 == norms and dw == 0.0, name


def _fallback_world(rank, world_size, case):
    group = dist.group.WORLD
    if case == "no shm dir":
        shm_collectives.SHM_DIR = "/nonexistent-megazero-shm"
    elif case == "full" and rank == 1:
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = full
    out = {"pid": os.getpid()}
    for impl in ("auto", "shared_memory"):
        comm = GroupComm(group, "dp", CommLog(), shared_memory=impl)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                buf = comm.shared_buffer(100, torch.float32, torch.device("cpu"))
                out[impl] = (comm.is_shared(buf), [str(w.message) for w in caught])
                buf.fill_(rank + 1.0)
                comm.all_reduce(buf, average=True)  # the backend's, and still right
                out[impl] += (buf[0].item(),)
            except ConfigError as e:
                out[impl] = str(e)
    return out


@pytest.mark.parametrize("case", ["no shm dir", "full"])
def test_a_group_that_cannot_share_memory_uses_the_backend(case):
    outs = run_distributed(_fallback_world, 2, case, timeout=120)
    for rank, out in enumerate(outs):
        shared, warned, value = out["auto"]
        assert not shared and value == 1.5
        if case == "full":  # the group qualified, the buffer did not fit: say so, on rank 0
            assert len(warned) == (1 if rank == 0 else 0), warned
            assert all("cannot reserve" in w and "No space" in w for w in warned)
            assert "rank 1 cannot reserve" in out["shared_memory"]
        else:
            assert warned == []
            assert "/nonexistent-megazero-shm is missing" in out["shared_memory"]
        assert "use 'auto'" in out["shared_memory"]
    assert _leftover_files([out["pid"] for out in outs]) == []


def test_an_unknown_shared_memory_choice_is_a_config_error():
    with pytest.raises(ConfigError, match="shared_memory 'yes': expected one of auto, "
                                          "backend, shared_memory"):
        GroupComm(None, "dp", CommLog(), shared_memory="yes")
