"""The NCCL-rules test mode (megazero/testing/nccl_rules.py) catches what gloo forgives: a host
buffer handed to a collective, ranks whose collectives do not pair up, a collective waiting
behind one rank's solo work. Each planted defect fails the mode; the same run without the
defect passes it. ZeRO-3 with NVMe parameter offload and one slow disk issues the same
collectives on every rank."""

import time

import pytest
import torch
import torch.distributed as dist

from megazero.config import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed import collectives, host_resident
from megazero.distributed.topology import ParallelTopology
from megazero.testing import DistributedTestError, run_distributed
from megazero.testing.nccl_rules import NcclRuleError
from megazero.testing.reference import TinyLM, engine_train_step, make_batches
from megazero.zero import build_zero_optimizer

OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
       "reduce_scatter_tensor", "all_to_all_single", "batch_isend_irecv",
       "megazero.distributed.collectives.reduce_scatter",
       "megazero.distributed.collectives.all_gather"]


def _calls(rank, world, t, out):
    """Each op of OPS with ``t`` (numel 2*world; its first two elements as a shard) as the
    rank's own tensor and ``out`` (numel 2*world) as the other side."""
    peer = (rank + 1) % world
    g = dist.new_group(list(range(world)))
    return {
        "all_reduce": lambda: dist.all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, src=0),
        "reduce": lambda: dist.reduce(t, dst=0),
        "all_gather": lambda: dist.all_gather(list(out.chunk(world)), t[:2]),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, t[:2]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t[:2], out),
        "all_to_all_single": lambda: dist.all_to_all_single(out, t),
        "batch_isend_irecv": lambda: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, out, peer)])],
        "megazero.distributed.collectives.reduce_scatter": lambda: collectives.reduce_scatter(
            t[:2], out, g, collectives.reduce_scatter_impl("auto", "gloo")),
        "megazero.distributed.collectives.all_gather": lambda: collectives.all_gather(
            out, t[:2], g),
    }


def _host_buffers_world(rank, world):
    n = 2 * world
    refused = []
    host = host_resident.host_empty(n, torch.float32).fill_(1.0)
    for name, call in _calls(rank, world, host, torch.zeros(n)).items():
        try:
            call()
        except NcclRuleError as e:  # raised before the call is issued, on every rank alike
            refused.append((name, str(e)))
    # the same calls on ordinary tensors (a host buffer's copy is one) all go through
    for call in _calls(rank, world, host.clone(), torch.zeros(n)).values():
        call()
    return refused


def test_a_host_resident_buffer_is_refused_by_every_collective():
    for refused in run_distributed(_host_buffers_world, 2, nccl_rules=True):
        assert [name for name, _ in refused] == OPS
        for _, msg in refused:
            assert "keeps on the host" in msg and "float32[" in msg, msg


# --------------------------------------------------------------- (a) item 1 put back on purpose

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
VOCAB = 64
MAX_LIVE = 1800


def _offloaded_engine(stage):
    """ZeRO ``stage`` with the optimizer offloaded to the CPU, after one training step."""
    topo = ParallelTopology.build()
    model = TinyLM(vocab=VOCAB)
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadConfig(device="cpu"))
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(), topo)
    rows = 8 // topo.dp_size
    for tokens, labels in make_batches(1, 8, 8, VOCAB):
        engine_train_step(model, engine, tokens[topo.dp_rank * rows:(topo.dp_rank + 1) * rows],
                          labels[topo.dp_rank * rows:(topo.dp_rank + 1) * rows], 1)
    return topo, model, engine


def _save_summing_masters_in_place(engine, topo):
    """What the save did before it kept its sums on the device: all-reduce the masters and
    moments where they live (item 1 restored). Returns, per tensor, the mode's error."""
    refused = {}
    with engine.masters.resident():
        pc = engine.masters.pieces[0]
        state = engine.masters.optimizer.state[pc.master]
        for name, t in (("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]),
                        ("master", pc.master.detach())):
            try:
                dist.all_reduce(t, group=topo.dp_group)
            except NcclRuleError as e:  # raised before the call, on every rank alike
                refused[name] = str(e)
    return refused


def _item1_world(rank, world, stage):
    topo, model, engine = _offloaded_engine(stage)
    return _save_summing_masters_in_place(engine, topo)


def test_all_reducing_offloaded_masters_in_a_save_fails_the_mode():
    """Masters and both moments of a CPU-offloaded optimizer (stages 1 and 3) are refused by
    the mode. Without the planted save the same training passes it (tests/test_zero_*.py run
    under the mode, CPU offload at every stage included)."""
    for stage in (1, 3):
        for refused in run_distributed(_item1_world, 2, stage, nccl_rules=True):
            assert sorted(refused) == ["exp_avg", "exp_avg_sq", "master"], (stage, refused)
            for msg in refused.values():
                assert msg.startswith("all_reduce over ranks [0,1] at test_nccl_rules.py")
                assert "_save_summing_masters_in_place" in msg and "keeps on the host" in msg


# ------------------------------------------- (b) ZeRO-3 + NVMe parameters, one rank's disk slow

def _slow_disk():
    """Every parameter-swap read on this rank completes 30 ms after it was issued."""
    from concurrent.futures import ThreadPoolExecutor

    from megazero.zero.swap import Pending, SwapIO

    pool = ThreadPoolExecutor(2)
    read = SwapIO.read

    def slow_read(self, fd, tensor, offset):
        def late():
            time.sleep(0.03)
            read(self, fd, tensor, offset).wait()
        return Pending([pool.submit(late)])

    SwapIO.read = slow_read


def _prefetch_stopping_at_unread_shards(self, pos, direction):
    """The prefetch before the fix: it stopped at the first shard whose read had not finished."""
    budget = self.zero.stage3_prefetch_bucket_size
    i = pos + direction
    while 0 <= i < len(self.order) and budget > 0:
        u = self.order[i]
        if u.full is None and not u.persistent:
            if self.live + u.padded > self.zero.stage3_max_live_parameters:
                break
            if u.swap is not None and not self._swapper().ready(u.swap.slot):
                break
            self._gather(u, async_op=True)
            budget -= u.padded
        i += direction
    if self.swap is not None:
        self._read_ahead(i, direction)


def _zero3_losses(rank, param_offload, steps=3):
    topo = ParallelTopology.build()
    model = TinyLM(vocab=VOCAB, hidden=16, layers=3)
    # a live-parameter bound between one unit and all of them: how much a rank prefetched
    # decides whether a unit stays gathered after its forward
    zero = ZeroConfig(stage=3, offload_optimizer=OffloadConfig(device="cpu"),
                      offload_param=param_offload, stage3_param_persistence_threshold=0,
                      stage3_max_live_parameters=MAX_LIVE, stage3_prefetch_bucket_size=10_000,
                      overlap_comm=True, reduce_bucket_size=600)
    engine = build_zero_optimizer([model], OPT, zero, PrecisionConfig(), topo)
    rows = 8 // topo.dp_size
    losses = []
    for tokens, labels in make_batches(steps, 8, 8, VOCAB):
        loss, _ = engine_train_step(model, engine, tokens[rank * rows:(rank + 1) * rows],
                                    labels[rank * rows:(rank + 1) * rows], 1)
        losses.append(loss)
    return losses


def _nvme_params_world(rank, world, tmp, old_prefetch):
    from megazero.zero.stage3 import Stage3Params

    reference = None if old_prefetch else _zero3_losses(rank, OffloadConfig(device="cpu"))
    if old_prefetch:
        Stage3Params._prefetch = _prefetch_stopping_at_unread_shards
    if rank == 1:
        _slow_disk()
    nvme = OffloadConfig(device="nvme", nvme_path=tmp, buffer_count=8, buffer_size=1024,
                         max_in_cpu=0)
    return reference, _zero3_losses(rank, nvme)


def test_zero3_nvme_params_with_one_slow_disk_issue_the_same_collectives(tmp_path):
    for reference, losses in run_distributed(_nvme_params_world, 2, str(tmp_path), False,
                                             nccl_rules=True, timeout=60):
        assert losses == reference and losses[-1] < losses[0]  # as with the shards in memory
    (tmp_path / "old").mkdir()
    with pytest.raises(DistributedTestError, match=r"NCCL rules: ranks \[0,1\] diverge") as e:
        run_distributed(_nvme_params_world, 2, str(tmp_path / "old"), True, nccl_rules=True,
                        timeout=30)
    print(e.value)


# ------------------------------------ (c) an all-reduce over a host tensor in the engine

def _engine_world(rank, world, planted):
    import megazero
    from megazero.engine.engine import MegazeroEngine
    from megazero.testing import engine_runs as er

    if planted:
        report = MegazeroEngine._report

        def report_summing_a_master(self):
            """A report that sums an offloaded fp32 master over the ranks where it lives."""
            dist.all_reduce(self.optimizer.masters.pieces[0].master)
            report(self)

        MegazeroEngine._report = report_summing_a_master
    model = er.build("plain")
    engine, _, _, _ = megazero.initialize(model=model, config=er.ds_config(2, offload=True))
    return er.train_steps(engine, "plain", er.batches(2, er.MICRO * er.GAS * world), 0, 2, rank)


def test_an_engine_all_reducing_a_host_tensor_fails_the_mode():
    """The same run without the planted report passes the mode in tests/test_engine_api.py
    (ZeRO-2 + CPU offload, equal to the one-process reference)."""
    with pytest.raises(DistributedTestError, match=r"all_reduce .*report_summing_a_master.*"
                                                   r"keeps on the host"):
        run_distributed(_engine_world, 2, True, nccl_rules=True)


# ------------------------------------------------------------------ the log comparison itself

def _write_logs(tmp_path, per_rank):
    from megazero.testing import nccl_rules

    for rank, lines in enumerate(per_rank):
        with open(nccl_rules.log_path(str(tmp_path), rank), "w") as f:
            f.writelines(f"{key}\t{entry}\tx.py:{i}\n" for i, (key, entry) in enumerate(lines))


def test_logs_agree_or_name_the_first_divergence(tmp_path):
    from megazero.testing.nccl_rules import LogReader, compare_logs

    ar4, ar8 = ("0,1,2", "all_reduce float32[4]"), ("0,1,2", "all_reduce float32[8]")
    p2p = ("0->2", "p2p bfloat16[6]")
    sub = ("0,1", "broadcast float32[3] src=1")
    # group [0,1,2]; a subgroup [0,1] interleaved differently on its ranks is fine
    _write_logs(tmp_path, [[ar4, sub, p2p, ar8], [sub, ar4, ar8], [ar4, p2p, ar8]])
    assert compare_logs(str(tmp_path), 3) is None
    # rank 2 skips a collective: index 1 differs; the running check sees it too
    _write_logs(tmp_path, [[ar4, ar8, ar4], [ar4, ar8, ar4], [ar4, ar4]])
    msg = LogReader(str(tmp_path), 3).divergence(finished=False)
    assert msg.startswith("ranks [0,1,2] diverge at call #1 of that group: rank 0 issued "
                          "all_reduce float32[8] (at x.py:1), rank 2 issued all_reduce "
                          "float32[4] (at x.py:1)"), msg
    # a receive with no matching send: only a finished world calls that a divergence
    _write_logs(tmp_path, [[ar4], [ar4], [ar4, p2p]])
    assert LogReader(str(tmp_path), 3).divergence(finished=False) is None
    assert "ranks [0->2] diverge at call #0 of that group: rank 0 issued nothing" in \
        compare_logs(str(tmp_path), 3)


def _waits_world(rank, world):
    if rank == 0:
        time.sleep(1.5)  # solo work while rank 1 sits in the barrier
    dist.barrier()


def test_a_collective_waiting_behind_solo_work_fails():
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed:\nNcclRuleError: "
                                                   r"barrier over ranks \[0,1\] .* waited"):
        run_distributed(_waits_world, 2, nccl_rules=True, nccl_wait_limit=0.5)
    run_distributed(_waits_world, 2, nccl_rules=True, nccl_wait_limit=5.0)


# ------------------------------------------ zero.Init(remote_device="cpu"): host-kept shards

def _remote_cpu_world(rank, world):
    from torch import nn

    from megazero.zero import init_context

    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    torch.manual_seed(0)
    with init_context.Init(remote_device="cpu"):
        lin = nn.Linear(6, 5)
    full = init_context.gather_partitioned(lin.weight)
    return torch.equal(full, ref.weight.detach()), tuple(lin.weight.mz_shard.shape)


def test_init_with_remote_cpu_gathers_device_copies_of_its_host_shards():
    """The shards zero.Init keeps on the host are host-resident; gathering one copies it to the
    parameter's device first (under NCCL a host shard cannot be gathered), with the values of
    the unpartitioned module."""
    assert run_distributed(_remote_cpu_world, 2, nccl_rules=True) == [(True, (15,))] * 2
