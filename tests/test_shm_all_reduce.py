"""The shared-memory all-reduce (:mod:`megazero.shm_all_reduce`): its sums against the
backend's, how the ZeRO engine uses it at stage 0, and what happens when a group cannot."""

import errno
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from megazero import shm_all_reduce
from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.errors import ConfigError
from megazero.shm_all_reduce import SharedSlots, merge_ranges
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, engine_train_step, make_batches
from megazero.topology import ParallelTopology
from megazero.zero import build_zero_optimizer
from megazero.zero.comm import CommLog, GroupComm


def _leftover_files(pids) -> list[str]:
    """The shared-memory files left by processes ``pids``."""
    prefixes = tuple(f"megazero-{pid}-" for pid in pids)
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefixes))


def _sums_world(rank, world_size):
    group = dist.group.WORLD
    numel = 1000
    seg, reason = SharedSlots.create(group, numel, torch.float32)
    assert seg is not None, reason
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    mapped_files = _leftover_files(pids)  # every rank has unlinked its file
    assert torch.equal(seg.local, torch.zeros(numel))
    g = torch.Generator().manual_seed(rank)
    out = []
    # ranges: averaged, summed, adjacent (merged), shorter than the group, at the end
    ranges = [(0, 300, True), (300, 301, False), (301, 302, False), (500, 997, True),
              (997, 1000, False)]
    for _ in range(3):  # the buffer is reused: after a reduction it is this rank's again
        seg.local.copy_(torch.randn(numel, generator=g))
        everyone = [torch.empty(numel) for _ in range(world_size)]
        dist.all_gather(everyone, seg.local.clone())
        expect = seg.local.clone()
        total = torch.stack(everyone).sum(0)
        for lo, hi, avg in ranges:
            expect[lo:hi] = total[lo:hi] / world_size if avg else total[lo:hi]
        seg.reduce(merge_ranges(ranges))
        out.append((seg.local - expect).abs().max().item())
    return out, mapped_files, seg.owns(seg.local[10:20]), seg.owns(torch.zeros(3)), pids


def test_shared_memory_sums_match_the_backends_and_leave_no_files():
    results = run_distributed(_sums_world, 3, timeout=120)
    for diffs, files, inside, outside, _ in results:
        assert max(diffs) < 1e-6, diffs  # three ranks: the sum order differs from gloo's
        assert inside == (10, 20) and outside is None
        assert files == [], files  # unlinked once every rank had mapped them
    assert _leftover_files(results[0][4]) == []


def test_merge_ranges_joins_neighbours_with_the_same_averaging():
    assert merge_ranges([(5, 9, True), (0, 5, True), (9, 12, False), (12, 20, False)]) == [
        (0, 9, True), (9, 20, False)]


def _engine_world(rank, world_size):
    topo = ParallelTopology.build()
    opt = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    batches = make_batches(4, 8, 8, 64)
    rows = 8 // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    runs, flushes = {}, {}
    for name, zkw, impl, micro in [
            ("gloo", dict(stage=0, overlap_comm=True), "backend", 1),
            ("shm overlap", dict(stage=0, overlap_comm=True), "auto", 1),
            ("shm", dict(stage=0, overlap_comm=False), "shared_memory", 1),
            ("shm accumulation", dict(stage=0), "auto", 2),
            ("shm copy mode", dict(stage=0, contiguous_gradients=False), "auto", 1),
            ("gloo stage 1 all-reduce", dict(stage=1, reduce_scatter=False), "backend", 1),
            ("shm stage 1 all-reduce", dict(stage=1, reduce_scatter=False), "auto", 1)]:
        model = TinyLM(vocab=64)
        engine = build_zero_optimizer([model], opt, ZeroConfig(reduce_bucket_size=300, **zkw),
                                      PrecisionConfig(), topo, all_reduce_impl=impl)
        shared = all(engine.comms.dp.is_shared(s.grad_flat) for s in engine.stores)
        losses, norms = [], []
        for tokens, labels in batches:
            loss, res = engine_train_step(model, engine, tokens[mine], labels[mine], micro)
            losses.append(loss)
            norms.append(res.grad_norm)
        flushes[name] = engine.comms.dp.flushes
        runs[name] = (shared, losses, norms,
                      {n: p.detach().clone() for n, p in model.named_parameters()})
    out = {}
    for name, (shared, losses, norms, w) in runs.items():  # tensors stay in the rank
        ref = runs["gloo stage 1 all-reduce" if "stage 1" in name else "gloo"][3]
        out[name] = (shared, losses, norms, max((w[k] - ref[k]).abs().max().item() for k in ref),
                     flushes[name])
    return out


def test_stage0_through_shared_memory_equals_gloo_bit_for_bit():
    for runs in run_distributed(_engine_world, 2, timeout=300):
        for name, (shared, l2, n2, dw, flushes) in runs.items():
            assert shared == name.startswith("shm"), name
            if not shared:
                continue
            # every bucket reduced in one pass per step, also without overlap_comm: a bucket
            # reduced where backward finished it would wait there for the slowest rank
            assert flushes == 4, (name, flushes)
            _, losses, norms, _, _ = runs["gloo stage 1 all-reduce" if "stage 1" in name
                                       else "gloo"]
            if name == "shm accumulation":  # two micro-batches: compare with the 1-batch run
                assert max(abs(a - b) for a, b in zip(losses, l2)) < 1e-5, name
                assert dw < 1e-5, name
                continue
            # two ranks: a + b in either order, and /2 before or after the sum, are exact
            assert l2 == losses and n2 == norms and dw == 0.0, name


def _fallback_world(rank, world_size, case):
    group = dist.group.WORLD
    if case == "no shm dir":
        shm_all_reduce.SHM_DIR = "/nonexistent-megazero-shm"
    elif case == "full" and rank == 1:
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = full
    out = {"pid": os.getpid()}
    for impl in ("auto", "shared_memory"):
        comm = GroupComm(group, "dp", CommLog(), all_reduce_impl=impl)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                buf = comm.reduce_buffer(100, torch.float32, torch.device("cpu"))
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
