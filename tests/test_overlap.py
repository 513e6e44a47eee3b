"""Megatron's overlap settings: ``--overlap-grad-reduce``, ``--overlap-param-gather`` and
``--ddp-bucket-size`` with their meaning, on by default (40M-element buckets) for NCCL runs and
off on gloo, an explicit JSON value winning over the default; on 2 gloo ranks the step
breakdown shows each bucket's gradient reduction launched during backward and waited after it,
and the parameters' all-gather launched in the step and waited in the next forward, with the
same losses and weights as without overlap; ZeRO-2 frees a bucket's staging buffer once its
reduce-scatter finished, not at the end of backward."""

import json

import pytest
import torch

from megazero.config import ConfigError, OptimizerConfig, PrecisionConfig, ZeroConfig, load_config
from megazero.distributed.group_comm import Handle
from megazero.distributed.topology import ParallelTopology
from megazero.observability.monitor import Timers
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, make_batches
from megazero.zero import build_zero_optimizer
from megazero.zero.buffers import GradBuffer

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --train-iters 1").split()


def _zero(argv, world=8, ds=None, tmp=None):
    if ds is not None:
        path = tmp / "ds.json"
        path.write_text(json.dumps(ds))
        argv = argv + ["--deepspeed_config", str(path)]
    z = load_config(BASE + argv, world).zero
    return z.overlap_comm, z.overlap_param_gather, z.reduce_bucket_size


def test_defaults_by_backend_and_flags(tmp_path):
    nccl = ["--distributed-backend", "nccl"]
    assert _zero(nccl) == (True, True, 40_000_000)
    assert _zero(nccl, world=64) == (True, True, 64_000_000)  # max(40M, 1M x dp)
    assert _zero(["--distributed-backend", "gloo"]) == (False, False, 500_000_000)
    assert _zero(["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
                  "1000"]) == (True, True, 1000)
    assert _zero(nccl + ["--no-overlap-grad-reduce", "--no-overlap-param-gather"]) == (
        False, False, 40_000_000)
    # explicit JSON values win over the NCCL defaults; "auto" takes them
    ds = {"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 5e8}}
    assert _zero(nccl, ds=ds, tmp=tmp_path) == (False, True, 500_000_000)
    ds = {"zero_optimization": {"overlap_comm": "auto"}}
    assert _zero(nccl, ds=ds, tmp=tmp_path)[0] is True
    with pytest.raises(ConfigError, match="--ddp-bucket-size 1000 on the command line conflicts"):
        _zero(["--ddp-bucket-size", "1000"], ds={"zero_optimization": {
            "reduce_bucket_size": 2000}}, tmp=tmp_path)


def _world(rank, world_size):
    topo = ParallelTopology.build()
    batches = make_batches(3, 4, 8, 256)
    rows = slice(rank * 2, rank * 2 + 2)
    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            model = TinyLM(vocab=256, hidden=32, layers=2)
            engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-2), ZeroConfig(
                stage=stage, overlap_comm=overlap, overlap_param_gather=overlap,
                reduce_bucket_size=3000), PrecisionConfig(), topo, shared_memory="backend")
            timers = Timers()
            engine.comms.set_timers(timers)
            phases: dict[str, set[str]] = {"forward": set(), "backward": set(), "step": set()}
            losses, in_flight_after_step, in_flight_after_forward = [], [], []
            buckets = [b for s in engine.stores for b in s.buckets]
            for tokens, labels in batches:
                with timers.region("forward"):
                    loss = model(tokens[rows], labels[rows]).float().mean()
                phases["forward"] |= set(timers.pop_all())
                in_flight_after_forward.append(sum(b.gather is not None for b in buckets))
                with timers.region("backward"):
                    engine.backward(loss)
                phases["backward"] |= set(timers.pop_all())
                with timers.region("step"):
                    engine.finish_grad_sync()
                    engine.step()
                phases["step"] |= set(timers.pop_all())
                in_flight_after_step.append(sum(b.gather is not None for b in buckets))
                losses.append(loss.item())
            flights = timers.pop_overlapped()
            full = engine.full_parameters()
            weights = torch.cat([full[id(p)].reshape(-1) for p in model.parameters()]).tolist()
            out[(stage, overlap)] = dict(losses=losses, weights=weights, phases=phases,
                                         flights=flights, buckets=len(buckets),
                                         after_step=in_flight_after_step,
                                         after_forward=in_flight_after_forward)
    return out


def test_reduction_and_gather_in_flight_behind_compute_same_results():
    for out in run_distributed(_world, 2, timeout=300):
        for stage in (1, 2):
            base, ovl = out[(stage, False)], out[(stage, True)]
            assert ovl["losses"] == base["losses"], stage
            assert ovl["weights"] == base["weights"], stage
            n = ovl["buckets"]
            assert n >= 3  # several buckets, so that some wait behind others' compute
            # the gather is left in flight by the step and completed by the next forward
            assert ovl["after_step"] == [n] * 3 and ovl["after_forward"] == [0] * 3, ovl
            assert base["after_step"] == [0] * 3
            p = ovl["phases"]
            assert "comm dp/all_gather launch" in p["step"]
            assert "comm dp/all_gather wait" in p["forward"], p
            assert "comm dp/all_gather wait" not in p["step"], p
            assert "comm dp/all_gather wait" in base["phases"]["step"]
            # each bucket's reduction is launched from backward's hooks, waited after it
            assert "comm dp/reduce_scatter launch" in p["backward"], p
            assert "comm dp/reduce_scatter wait" in p["step"], p
            assert "comm dp/reduce_scatter launch" not in base["phases"]["backward"]
            flights = ovl["flights"]
            for op in ("reduce_scatter", "all_gather"):
                assert flights.get(f"comm dp/{op} in flight", 0.0) > 0.0, flights


class _Finished:
    def is_completed(self):
        return True

    def wait(self):
        pass


class _FakeDp:
    """Two ranks' bookkeeping with collectives that complete at once (this rank's half)."""

    size, rank, inplace_all_gather = 2, 0, True

    def shared_buffer(self, numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)

    def is_shared(self, t):
        return False

    def reduce_scatter(self, out, inp, async_op=False):
        out.copy_(inp.view(2, -1)[0])
        return Handle(_Finished())


def test_zero2_hands_each_staging_buffer_over_one_reduction_in_flight():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(4)]
    held, flying = {}, {}
    for overlap in (False, True):
        buf = GradBuffer(params, stage=2, dp=_FakeDp(), bucket_numel=4,
                         grad_dtype=torch.float32, contiguous_gradients=True,
                         reduce_scatter=True, overlap=overlap, deferred_kind={})
        held[overlap], flying[overlap] = [], []
        for p in reversed(params):  # backward's order; one bucket per parameter
            p.grad = torch.full_like(p, 2.0)
            buf.grad_ready(p)
            held[overlap].append(sum(b.grad is not None for b in buf.buckets))
            flying[overlap].append([b.index for b in buf.in_flight])
        buf.wait()
        assert all(b.grad is None for b in buf.buckets) and not buf.in_flight
        assert torch.equal(buf.shard_grad_flat, torch.ones(8))  # 2.0 / dp, this rank's halves
    # a launched bucket's staging buffer belongs to its reduction: no bucket holds one after
    # its launch; with overlap, each launch first waits for the one reduction in flight,
    # without it every reduction is blocking
    assert held[True] == held[False] == [0, 0, 0, 0]
    assert flying[True] == [[0], [1], [2], [3]] and flying[False] == [[]] * 4
