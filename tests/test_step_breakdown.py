"""``wall_clock_breakdown`` at the engine: every collective of a ZeRO step lands in its own
region (launch and wait for asynchronous ones, the whole call for blocking ones), asynchronous
collectives report their in-flight time, and the regions add up to the step's wall time."""

import time

import pytest

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.observability.monitor import Timers
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, make_batches
from megazero.zero import build_zero_optimizer


def _breakdown_world(rank, world_size):
    topo = ParallelTopology.build()
    out = {}
    for case in (0, "0-gloo", 1, "1-gloo", 2, 3):
        stage = int(str(case)[0])
        model = TinyLM(vocab=256, hidden=32, layers=2)
        engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-3),
                                      ZeroConfig(stage=stage, overlap_comm=True,
                                                 reduce_bucket_size=3000,
                                                 stage3_param_persistence_threshold=0),
                                      PrecisionConfig(), topo,
                                      shared_memory="backend" if "gloo" in str(case) else "auto")
        timers = Timers()
        engine.comms.set_timers(timers)
        for tokens, labels in make_batches(2, 4, 8, 256):
            timers.pop_all()
            timers.pop_overlapped()
            t0 = time.perf_counter()
            with timers.region("backward"):
                engine.zero_grad()
                engine.backward(model(tokens, labels).float().mean())
            with timers.region("optimizer"):
                engine.finish_grad_sync()
                engine.step()
            wall = time.perf_counter() - t0
        out[case] = (timers.pop_all(), wall, timers.pop_overlapped())
    return out


def test_every_collective_has_a_region_and_the_parts_add_up():
    got = run_distributed(_breakdown_world, 2, timeout=300)[0]
    expect = {0: {"comm dp/all_reduce launch", "comm dp/all_reduce wait"},
              "0-gloo": {"comm dp/all_reduce launch", "comm dp/all_reduce wait"},
              1: {"comm dp/reduce_scatter launch", "comm dp/reduce_scatter wait",
                  "comm dp/all_gather launch", "comm dp/all_gather wait"},
              "1-gloo": {"comm dp/reduce_scatter launch", "comm dp/reduce_scatter wait",
                         "comm dp/all_gather launch", "comm dp/all_gather wait"},
              2: {"comm dp/reduce_scatter launch", "comm dp/reduce_scatter wait",
                  "comm dp/all_gather launch", "comm dp/all_gather wait", "comm world/scalar"},
              3: {"comm dp/reduce_scatter launch", "comm dp/all_gather launch",
                  "comm dp/all_gather wait"}}
    for stage, (regions, wall, overlapped) in got.items():
        assert expect[stage] <= set(regions), (stage, sorted(regions))
        assert {"backward", "optimizer"} <= set(regions)
        assert sum(regions.values()) == pytest.approx(wall, rel=0.05, abs=0.002), stage
        # asynchronous collectives were timed from launch to the backend's completion; the
        # shared-memory ones (stages 0 and 1 here, on one host) run inside their wait instead
        flights = {k for k in overlapped if k.endswith(" in flight")}
        if stage in (0, 1):
            assert not flights, overlapped
            continue
        assert flights and all(v > 0 for v in overlapped.values()), (stage, overlapped)


class _FakeStream:
    """Where the compute stream has got to, in ms: kernels advance it, a wait on a collective
    moves it to the collective's end. The host does not wait for any of it."""

    pos = 0.0


class _FakeEvent:
    syncs = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = _FakeStream.pos

    def synchronize(self):
        _FakeEvent.syncs += 1

    def elapsed_time(self, other):
        assert self.t is not None and other.t is not None
        return other.t - self.t


class _FakeNcclWork:
    """NCCL's rule: the future completes when the work is enqueued (callbacks run at once),
    but with the callback's stream made to wait for the collective to finish."""

    def __init__(self, ms):
        self.end = _FakeStream.pos + ms

    def get_future(self):
        work = self

        class Future:
            def add_done_callback(self, cb):
                saved, _FakeStream.pos = _FakeStream.pos, max(_FakeStream.pos, work.end)
                try:
                    cb(self)
                finally:
                    _FakeStream.pos = saved

        return Future()


def test_gpu_breakdown_times_the_stream_without_synchronizing(monkeypatch):
    """On CUDA a region boundary records an event and never synchronises; the breakdown is
    resolved when read; a collective's in-flight time runs to its end on the device although
    NCCL's future completes at launch (a host clock there would read ~0)."""
    import torch

    def no_sync(*_a, **_k):
        raise AssertionError("a region boundary synchronised the device")

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    _FakeStream.pos, _FakeEvent.syncs = 0.0, 0
    t = Timers(device=torch.device("cuda", 0))
    for _ in range(2):  # a second iteration reuses the resolved events
        with t.region("backward"):
            _FakeStream.pos += 20  # kernels
            with t.region("comm dp/reduce_scatter launch"):
                work = _FakeNcclWork(50)
                t.time_in_flight("comm dp/reduce_scatter in flight", work)
            _FakeStream.pos += 30  # more backward kernels, beside the collective
            with t.region("comm dp/reduce_scatter wait"):
                _FakeStream.pos = max(_FakeStream.pos, work.end)  # work.wait()
            _FakeStream.pos += 5
    assert _FakeEvent.syncs == 0  # nothing waited for the device while the regions ran
    got = t.pop_all()
    assert _FakeEvent.syncs > 0
    assert got == pytest.approx({"backward": 2 * 0.055, "comm dp/reduce_scatter launch": 0.0,
                                 "comm dp/reduce_scatter wait": 2 * 0.020})
    assert t.pop_overlapped() == pytest.approx({"comm dp/reduce_scatter in flight": 2 * 0.050})
    assert t.pop_all() == {} and t.pop_overlapped() == {}
