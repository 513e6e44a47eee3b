"""NVMe offload (ZeRO-Infinity): optimizer states and stage-3 parameter shards in swap files
train exactly like CPU offload (same arithmetic on the same host tensors, only their home
differs), checkpoints round-trip, host buffers stay within the configured bytes, and a bad
``nvme_path`` is refused before training with the key and the fix."""

import json
import os
import stat
from dataclasses import replace

import pytest
import torch

from megazero.config import (
    AioConfig,
    ConfigError,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
)
from megazero.distributed.topology import ParallelTopology
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, engine_train_step, make_batches
from megazero.zero import build_zero_optimizer

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
STEPS, BATCH, SEQ, VOCAB = 4, 8, 8, 64
CPU = OffloadConfig(device="cpu")
SUB = 160  # sub_group_size: a dozen sub-groups per rank, so the swap pipeline really rotates


def _nvme(path, **kw) -> OffloadConfig:
    return OffloadConfig(device="nvme", nvme_path=str(path), **kw)


def _tiny() -> TinyLM:
    m = TinyLM(vocab=VOCAB)
    m.embedding.weight.zero_external = True
    return m


def _train(topo, zero: ZeroConfig, steps=STEPS, engine_out=None, bf16=False):
    batches = make_batches(steps, BATCH, SEQ, VOCAB)
    rows = BATCH // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    model = _tiny()
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(bf16=bf16), topo)
    losses = []
    for tokens, labels in batches:
        loss, res = engine_train_step(model, engine, tokens[mine], labels[mine], 1)
        assert res.updated
        losses.append(loss)
    full = engine.full_parameters()
    weights = {n: full[id(p)] for n, p in model.named_parameters()}
    if engine_out is not None:
        engine_out.append((model, engine))
    return losses, weights


def _same(a, b):
    """Bitwise: losses as floats, weights with torch.equal."""
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _cases(tmp):
    base = dict(sub_group_size=SUB, stage3_param_persistence_threshold=0)
    out = []
    for stage in (1, 2, 3):
        for count in ((3, 9) if stage == 2 else (6,)):  # in turn; read ahead + write behind
            out.append((f"optimizer stage {stage} buffers {count}",
                        dict(base, stage=stage, offload_optimizer=CPU),
                        dict(base, stage=stage, offload_optimizer=_nvme(tmp, buffer_count=count))))
    cpu3 = dict(base, stage=3, offload_optimizer=CPU, offload_param=CPU)
    out.append(("params stage 3", cpu3,
                dict(cpu3, offload_param=_nvme(tmp, buffer_count=2, buffer_size=512,
                                               max_in_cpu=0))))
    out.append(("params + optimizer stage 3 overlap", dict(cpu3, overlap_comm=True),
                dict(cpu3, overlap_comm=True,
                     offload_optimizer=_nvme(tmp, buffer_count=6),
                     offload_param=_nvme(tmp, buffer_count=3, buffer_size=512, max_in_cpu=600))))
    # bf16: the swap file holds bf16 shards, the optimizer casts fp32 masters into it
    out.append(("params + optimizer stage 3 bf16", dict(cpu3, bf16=True),
                dict(cpu3, bf16=True, offload_optimizer=_nvme(tmp, buffer_count=9),
                     offload_param=_nvme(tmp, buffer_size=512, max_in_cpu=0))))
    return out


def _equal_world(rank, world_size, tmp):
    topo = ParallelTopology.build()
    out = []
    for name, ref_kw, kw in _cases(tmp):
        engines = []
        bf16 = kw.pop("bf16", False) | ref_kw.pop("bf16", False)
        ref = _train(topo, ZeroConfig(**ref_kw), bf16=bf16)
        got = _train(topo, ZeroConfig(**kw), engine_out=engines, bf16=bf16)
        engine = engines[0][1]
        pswap = getattr(engine.stores[0], "swap", None)
        ahead = (pswap.fetches, pswap.fetched_ahead) if pswap is not None else None
        files = sorted(os.listdir(os.path.join(tmp, "megazero_swap", f"rank{rank}")))
        out.append((name, _same(ref, got), ref[0], got[0], ahead, files))
    return out


def test_nvme_offload_trains_bitwise_like_cpu_offload(tmp_path):
    per_rank = run_distributed(_equal_world, 2, str(tmp_path), timeout=200)
    for rank, results in enumerate(per_rank):
        assert [r[0] for r in results] == [c[0] for c in _cases(tmp_path)]
        for name, same, ref_losses, losses, ahead, files in results:
            assert same, f"rank {rank} {name}: {ref_losses} != {losses}"
            assert ref_losses[-1] < ref_losses[0], name  # it trained
            assert "optimizer" in files
            if name.startswith("params"):
                assert "params" in files
                # every step gathers each swapped unit in the forward and the backward; after
                # the first (recording) forward most shards were read ahead by the prefetch path
                fetches, fetched_ahead = ahead
                assert fetches >= 2 * STEPS and fetched_ahead >= fetches // 2, (name, ahead)


# ------------------------------------------------------------------ bad nvme_path, early

def _topo1():
    from megazero.config.layout import ParallelLayout

    return ParallelTopology(ParallelLayout(world_size=1), rank=0)


def _build(zero):
    return build_zero_optimizer([_tiny()], OPT, zero, PrecisionConfig(), _topo1())


def test_nvme_path_missing_is_a_config_error():
    with pytest.raises(ConfigError, match=r'offload_optimizer.device is "nvme" but '
                                          r"zero_optimization.offload_optimizer.nvme_path is not "
                                          r'set; set "nvme_path"'):
        _build(ZeroConfig(stage=1, offload_optimizer=OffloadConfig(device="nvme")))


def test_nvme_path_that_does_not_exist(tmp_path):
    gone = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_param.nvme_path: .*nope' "
                                          r"does not exist; create the directory"):
        _build(ZeroConfig(stage=3, stage3_param_persistence_threshold=0,
                          offload_param=_nvme(gone, max_in_cpu=0)))


def test_nvme_path_not_writable(tmp_path):
    """A directory this process cannot create files in: read-only permissions for a normal
    user; for root (who ignores permissions) a kernel directory that refuses new entries."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    target = "/proc/self" if os.geteuid() == 0 else str(ro)
    try:
        with pytest.raises(ConfigError, match=r"offload_optimizer.nvme_path: cannot write swap "
                                              r"files under .*give a directory this user can"):
            _build(ZeroConfig(stage=2, offload_optimizer=_nvme(target)))
    finally:
        ro.chmod(stat.S_IRWXU)


def test_nvme_path_too_small(tmp_path, monkeypatch):
    """statvfs reports 8 KiB free: the tiny model's optimizer state (3 x 4 bytes x ~5k
    elements, aligned) does not fit, and the message gives both numbers."""
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 8192 // st.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Small(real(p)))
    with pytest.raises(ConfigError, match=r"offload_optimizer.nvme_path: .* has 0.00 GiB free, "
                                          r"this rank's swap files need .* point nvme_path at a "
                                          r"larger disk"):
        _build(ZeroConfig(stage=1, offload_optimizer=_nvme(tmp_path)))


def test_disk_filled_by_others_before_the_swap_file_is_reserved(tmp_path, monkeypatch):
    """statvfs said yes, then another rank took the space: reserving the file fails with
    ENOSPC, which is a ConfigError too (not a sparse file that fails mid-run)."""
    import errno

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match=r"offload_param.nvme_path: no space left for a "
                                          r"\d+-byte swap file"):
        _build(ZeroConfig(stage=3, stage3_param_persistence_threshold=0,
                          offload_param=_nvme(tmp_path, max_in_cpu=0)))


def test_too_few_optimizer_buffers(tmp_path):
    with pytest.raises(ConfigError, match=r"offload_optimizer.buffer_count: got 2; .* at least "
                                          r"3 buffers"):
        _build(ZeroConfig(stage=1, offload_optimizer=_nvme(tmp_path, buffer_count=2)))


def test_param_buffer_smaller_than_a_shard(tmp_path):
    with pytest.raises(ConfigError, match=r"offload_param.buffer_size: 100 elements .* shard of "
                                          r"\d+ elements; set buffer_size to at least \d+"):
        _build(ZeroConfig(stage=3, stage3_param_persistence_threshold=0,
                          offload_param=_nvme(tmp_path, buffer_size=100, max_in_cpu=0)))


# ------------------------------------------------------------------ host memory is bounded

def test_swap_buffers_are_the_only_host_allocation_and_stay_fixed(tmp_path):
    """The optimizer swapper allocates its slots once (buffer_count // 3 of them, each three
    aligned sub-groups) and nothing more over the steps, whatever the state size; every
    sub-group passes through those slots (bytes read = bytes written = the state file size)."""
    allocs = []
    import megazero.zero.swap as swap_mod

    real = swap_mod.aligned_host_empty

    def counting(numel, dtype, pin):
        t = real(numel, dtype, pin)
        allocs.append(t.untyped_storage().nbytes())  # what was allocated, alignment included
        return t

    mp = pytest.MonkeyPatch()
    mp.setattr(swap_mod, "aligned_host_empty", counting)
    try:
        zero = ZeroConfig(stage=1, sub_group_size=SUB,
                          offload_optimizer=_nvme(tmp_path, buffer_count=7))
        engines = []
        _train(_topo1(), zero, steps=3, engine_out=engines)
    finally:
        mp.undo()
    swap = engines[0][1].masters.swap
    width = -(-SUB // 1024) * 1024  # sub-group numel rounded up to 4 KiB of fp32
    # 7 // 3 = 2 slots, allocated once, at build: 3 sub-groups of fp32 + 4 KiB to align
    assert allocs == [3 * width * 4 + 4096] * 2
    assert swap.allocated_bytes == sum(allocs) <= 7 * width * 4 + 2 * 4096
    total = sum(-(-n // 1024) * 1024 for n in swap.numels) * 4 * 3
    assert swap.file_bytes * 3 == total
    assert swap.last_stream["bytes_read"] == swap.last_stream["bytes_written"] == total
    report = engines[0][1].memory_report()
    assert report["bytes"]["optimizer"]["offload"] == sum(allocs)  # slots, not the state


# ------------------------------------------------------------------ checkpoints

def _ckpt_world(rank, world_size, tmp, stage):
    topo = ParallelTopology.build()
    off = dict(offload_optimizer=_nvme(tmp, buffer_count=6))
    if stage == 3:
        off["offload_param"] = _nvme(tmp, buffer_size=512, max_in_cpu=0)
    zero = ZeroConfig(stage=stage, sub_group_size=SUB, stage3_param_persistence_threshold=0,
                      **off)
    batches = make_batches(6, BATCH, SEQ, VOCAB)
    rows = BATCH // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)

    def steps(model, engine, bs):
        return [engine_train_step(model, engine, t[mine], y[mine], 1)[0] for t, y in bs]

    model = _tiny()
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(), topo)
    steps(model, engine, batches[:3])
    sd = engine.state_dict()
    with engine.gathered_parameters():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    straight = steps(model, engine, batches[3:])
    model2 = _tiny()
    engine2 = build_zero_optimizer([model2], OPT, zero, PrecisionConfig(), topo)
    with engine2.gathered_parameters(write_back=True):
        model2.load_state_dict(weights)
    engine2.load_state_dict(sd)
    resumed = steps(model2, engine2, batches[3:])
    return straight, resumed


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_state_dict_round_trip_resumes_bitwise(tmp_path, stage):
    for straight, resumed in run_distributed(_ckpt_world, 2, str(tmp_path), stage, timeout=120):
        assert straight == resumed


def test_checkpoint_files_round_trip_with_nvme_offload(tmp_path):
    """The layout-independent checkpoint (``train_in_rank``): a run with NVMe optimizer
    offload saved at iteration 2 and resumed to 4 has the losses of the run straight to 4."""
    from megazero.testing.training_runs import TINY, train_in_rank

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "zero_optimization": {"stage": 2, "sub_group_size": 500, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 6}},
        "aio": {"block_size": 65536, "thread_count": 2}}))
    common = TINY + ["--deepspeed_config", str(ds)]
    straight = run_distributed(train_in_rank, 2, common + ["--train-iters", "4"])[0]
    ck = str(tmp_path / "ck")
    run_distributed(train_in_rank, 2, common + ["--train-iters", "2", "--save", ck,
                                                "--save-interval", "2"])
    resumed = run_distributed(train_in_rank, 2, common + ["--train-iters", "4", "--load", ck])[0]
    assert set(resumed) == {3, 4}
    assert all(resumed[i] == straight[i] for i in (3, 4)), (straight, resumed)


# ------------------------------------------------------------------ the JSON

def test_deepspeed_json_nvme_and_aio_keys_land_in_the_config(tmp_path):
    from megazero.config import load_config

    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", '
                  '"nvme_path": "/local_nvme", "buffer_count": 6, "pin_memory": true}, '
                  '"offload_param": {"device": "nvme", "nvme_path": "/local_nvme", '
                  '"buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}}, '
                  '"aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 2, '
                  '"single_submit": false, "overlap_events": true, "use_gds": false}}')
    cfg = load_config(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                       "--seq-length", "8", "--max-position-embeddings", "8",
                       "--micro-batch-size", "1", "--deepspeed_config", str(ds)], 1)
    z = cfg.zero
    assert z.offload_optimizer == OffloadConfig(device="nvme", pin_memory=True,
                                                nvme_path="/local_nvme", buffer_count=6)
    assert z.offload_param == OffloadConfig(device="nvme", nvme_path="/local_nvme",
                                            buffer_count=5, buffer_size=10**8, max_in_cpu=10**9)
    assert z.aio == AioConfig(block_size=262144, queue_depth=32, intra_op_parallelism=2)
    assert replace(z.aio, intra_op_parallelism=1) == AioConfig(block_size=262144, queue_depth=32)


def test_aio_values_are_checked():
    from megazero.zero.offload import check_offload

    with pytest.raises(ConfigError, match=r"aio.queue_depth: got 0, expected an integer >= 1"):
        check_offload(ZeroConfig(aio=AioConfig(queue_depth=0)))
