"""ZeRO-3 gradient buckets (megazero/zero/stage3_grads.py): consecutive units' gradients are
reduce-scattered together, one collective per bucket of ``reduce_bucket_size`` elements.

On 2 gloo ranks, for buckets of one unit each, a few units, and the whole model, blocking and
overlapped: the gradient every rank ends with (its shards gathered back) equals the
single-process gradient of the whole batch, bit-for-bit the same at every bucket size; the
step issues exactly one reduce-scatter per bucket; a parameter that received no gradient
(an unused module sitting between used ones in a bucket) gets zeros and leaves its
neighbours' gradients intact.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.group_comm import Handle
from megazero.distributed.topology import ParallelTopology
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, make_batches
from megazero.zero import build_zero_optimizer
from megazero.zero.stage3_grads import Stage3Grads, plan_grad_buckets
from megazero.zero.units import Unit

VOCAB, HIDDEN, BATCH, SEQ = 96, 24, 4, 12


def test_plan_keeps_order_caps_size_and_isolates_deferred_units():
    assert plan_grad_buckets([5, 5, 5, 20, 3, 3], [False] * 6, 10) == [[0, 1], [2], [3], [4, 5]]
    assert plan_grad_buckets([5, 5, 5, 3], [False, True, False, False], 10) == [[0], [1], [2, 3]]
    assert plan_grad_buckets([4, 4], [False, False], 1) == [[0], [1]]
    assert plan_grad_buckets([4, 4, 4], [False] * 3, 10**9) == [[0, 1, 2]]
    assert plan_grad_buckets([], [], 10) == []


def _model() -> nn.Module:
    m = TinyLM(vocab=VOCAB, hidden=HIDDEN, layers=2)
    # never called: its unit sits between used ones and must come out zero
    m.blocks[0].unused = nn.Linear(HIDDEN, 7)
    return m


def _full_grads(engine, model) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient, from the rank's shards gathered over dp."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for store in engine.stores:
        for u in store.units:
            full = torch.empty(u.padded)
            dist.all_gather_into_tensor(full, u.grad_shard.contiguous())
            for p, s, shape in zip(u.params, u.starts, u.shapes):
                out[names[id(p)]] = full[s:s + shape.numel()].view(shape).clone()
    return out


def _buckets_world(rank, world_size, settings):
    torch.manual_seed(0)
    tokens, labels = make_batches(1, BATCH * world_size, SEQ, VOCAB)[0]
    ref = _model()
    ref(tokens, labels).float().mean().backward()
    ref_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                 for n, p in ref.named_parameters()}
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    rows = []
    for bucket, overlap in settings:
        topo = ParallelTopology.build()
        model = _model()
        zero = ZeroConfig(stage=3, reduce_bucket_size=bucket, overlap_comm=overlap,
                          stage3_param_persistence_threshold=0)
        engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-3), zero,
                                      PrecisionConfig(), topo)
        store = engine.stores[0]
        for _ in range(2):  # the first records the execution order; no update in between
            engine.zero_grad()
            engine.comms.log.reset()
            engine.backward(model(tokens[mine], labels[mine]).float().mean())
            engine.finish_grad_sync()
            calls = engine.comms.log.calls[("dp", "reduce_scatter")]
            grads = _full_grads(engine, model)
        rows.append(dict(
            bucket=bucket, overlap=overlap, calls=calls, buckets=len(store.buckets),
            units=len(store.units), sizes=[b.numel() for b in store.buckets],
            unit_sizes=[u.padded for u in store.units],
            firsts=[b.units[0].index for b in store.buckets],
            errs={n: (grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads},
            max_err=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            unused_zero=all(grads[n].eq(0).all().item() for n in grads if ".unused." in n),
            grads={n: g.numpy() for n, g in grads.items()}))  # numpy: pickled by value
    return rows


SETTINGS = [(1, False), (1, True), (3000, False), (3000, True), (10**9, True)]


@pytest.fixture(scope="module")
def rows():
    return run_distributed(_buckets_world, 2, SETTINGS, timeout=240)


def test_one_reduce_scatter_per_bucket(rows):
    for r in rows[0]:
        assert r["calls"] == r["buckets"], r
    by = {(r["bucket"], r["overlap"]): r for r in rows[0]}
    assert by[(1, False)]["buckets"] == by[(1, False)]["units"]  # every unit alone
    assert by[(10**9, True)]["buckets"] == 1  # the whole model in one collective
    few = by[(3000, True)]
    assert few["buckets"] == 3 and few["units"] == 9  # the layout the test is built for
    # greedy and in order: each bucket within the cap, and the next unit would not have fit
    assert sum(few["sizes"]) == sum(few["unit_sizes"]) and max(few["sizes"]) <= 3000
    for size, nxt in zip(few["sizes"], few["firsts"][1:]):
        assert size + few["unit_sizes"][nxt] > 3000, few


def test_bucketed_gradients_equal_the_single_process_gradient(rows):
    for rank_rows in rows:
        for r in rank_rows:
            assert r["max_err"] < 1e-6, (r["bucket"], r["overlap"], r["max_err"])
            assert r["unused_zero"], (r["bucket"], r["overlap"])
        first = rank_rows[0]["grads"]
        for r in rank_rows[1:]:  # the sums do not depend on how units are grouped
            for n, g in first.items():
                assert (g == r["grads"][n]).all(), (r["bucket"], r["overlap"], n)


class _Finished:
    """A collective that has already completed."""

    def is_completed(self):
        return True

    def wait(self):
        pass


class _Dp:
    size, rank = 2, 0

    def reduce_scatter(self, out, inp, async_op=False):
        out.copy_(inp.view(2, -1)[0])
        return Handle(_Finished())


class _Grads(Stage3Grads):
    def _release(self, u):
        pass


def test_a_launched_bucket_hands_its_input_over_one_reduction_in_flight():
    params = [nn.Parameter(torch.ones(4)) for _ in range(3)]
    g = _Grads()
    g.units = [Unit(i, [p], 2, 0, False, None) for i, p in enumerate(params)]
    g.unit_of_param = {id(p): u for p, u in zip(params, g.units)}
    g.dp, g.grad_dtype, g.device, g.overlap = _Dp(), torch.float32, torch.device("cpu"), True
    g.dtype = torch.float32
    g._build_grad_buckets(4)  # one unit per bucket
    g.zero_grad()
    held, flying = [], []
    for p in reversed(params):  # the backward's order
        p.grad = torch.full_like(p, 2.0)
        g.grad_ready(p)
        held.append([b.full is not None for b in g.buckets])
        flying.append([b.units[0].index for b in g.in_flight])
    # a launched bucket's input belongs to its collective, and each launch first waits for
    # the reduction in flight: never more than one bucket's input alive
    assert held == [[False] * 3] * 3 and flying == [[2], [1], [0]]
    g.wait()
    assert not g.in_flight
    assert all(b.full is None for b in g.buckets)
    assert all(torch.equal(u.grad_shard, torch.ones(2)) for u in g.units)  # 2.0 / dp
