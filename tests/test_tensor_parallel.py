"""Tensor-parallel building blocks on 4 gloo ranks against single-process references:
every mapping (forward and backward), the parallel layers, the vocab-parallel loss, shard
reassembly, the RNG tracker and checkpoint, and the configuration errors."""

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError, ModelConfig
from megazero.config.layout import ParallelLayout
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    gather_full_param,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    shard_full_param,
    vocab_parallel_cross_entropy,
)
from megazero.tensor_parallel.mappings import reduce_scatter_dim0
from megazero.tensor_parallel.utils import shard_tensor, unshard_tensor
from megazero.testing import run_distributed

W = 4  # ranks


def _same(seed, *shape):
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _per_rank(seed, rank, *shape):
    return _same(seed * 100 + rank, *shape)


def _check_mapping(fn, x, expected_out, upstream, expected_grad, name):
    x = x.clone().requires_grad_()
    y = fn(x)
    torch.testing.assert_close(y, expected_out, rtol=1e-6, atol=1e-6, msg=name)
    y.backward(upstream)
    torch.testing.assert_close(x.grad, expected_grad, rtol=1e-6, atol=1e-6, msg=name)


def _mappings(rank, world):
    topo = ParallelTopology.build(tp=W)
    g = topo.tp_group
    r = topo.tp_rank
    x_rep = _same(1, 8, 3, 4)  # replicated [s, b, h]
    xs = [_per_rank(2, q, 8, 3, 4) for q in range(W)]  # per-rank tensors
    ups = [_per_rank(3, q, 8, 3, 4) for q in range(W)]
    sum_x, sum_up = sum(xs), sum(ups)
    # copy: identity forward, all-reduce backward
    _check_mapping(lambda t: copy_to_tensor_parallel_region(t, g), x_rep, x_rep, ups[r],
                   sum_up, "copy_to")
    # reduce: all-reduce forward, identity backward
    _check_mapping(lambda t: reduce_from_tensor_parallel_region(t, g), xs[r], sum_x, ups[r],
                   ups[r], "reduce_from")
    # scatter last dim / gather last dim
    up_small = [u[..., :1] for u in ups]
    _check_mapping(lambda t: scatter_to_tensor_parallel_region(t, g), x_rep,
                   x_rep[..., r:r + 1], up_small[r], torch.cat(up_small, -1), "scatter_to_tp")
    x_small = [t[..., :1] for t in xs]
    _check_mapping(lambda t: gather_from_tensor_parallel_region(t, g), x_small[r],
                   torch.cat(x_small, -1), ups[r], ups[r][..., r:r + 1], "gather_from_tp")
    # sequence dim: scatter, gather (reduce-scatter backward), reduce-scatter
    _check_mapping(lambda t: scatter_to_sequence_parallel_region(t, g), x_rep,
                   x_rep[2 * r:2 * r + 2], ups[r][:2], torch.cat([u[:2] for u in ups]),
                   "scatter_to_sp")
    _check_mapping(lambda t: gather_from_sequence_parallel_region(t, g), xs[r][:2],
                   torch.cat([t[:2] for t in xs]), ups[r], sum_up[2 * r:2 * r + 2],
                   "gather_from_sp")
    _check_mapping(lambda t: gather_from_sequence_parallel_region(t, g, False), xs[r][:2],
                   torch.cat([t[:2] for t in xs]), x_rep, x_rep[2 * r:2 * r + 2],
                   "gather_from_sp replicated consumer")
    _check_mapping(lambda t: reduce_scatter_to_sequence_parallel_region(t, g), xs[r],
                   sum_x[2 * r:2 * r + 2], ups[r][:2], torch.cat([u[:2] for u in ups]),
                   "reduce_scatter_to_sp")
    # every reduce-scatter implementation gives this rank's slice of the sum
    for impl in ("native", "all_to_all", "all_reduce"):
        torch.testing.assert_close(reduce_scatter_dim0(xs[r], g, impl), sum_x[2 * r:2 * r + 2],
                                   rtol=1e-6, atol=1e-6, msg=impl)
    # no-ops without a group
    for f in (copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
              gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region):
        assert f(x_rep, None) is x_rep
    return True


def _layers(rank, world):
    topo = ParallelTopology.build(tp=W)
    g = topo.tp_group
    torch.manual_seed(7)  # same global RNG on all ranks -> same full init
    x = _same(4, 8, 2, 16)
    up = _same(5, 8, 2, 12)
    checks = 0
    for sp in (False, True):  # a row-parallel consumer needs contiguous (stride 1) shards
        ctx = ParallelContext(tp_group=g, sequence_parallel=sp)
        col = ColumnParallelLinear(16, 24, parallel=ctx, gather_output=False)
        row = RowParallelLinear(24, 12, parallel=ctx)
        with torch.no_grad():
            col.bias.copy_(shard_full_param(_same(6, 24), col.bias, topo))
            row.bias.normal_(generator=torch.Generator().manual_seed(8))
        ref_c = torch.nn.Linear(16, 24)
        ref_r = torch.nn.Linear(24, 12)
        for ref, mod in ((ref_c, col), (ref_r, row)):
            with torch.no_grad():
                ref.weight.copy_(gather_full_param(mod.weight, topo))
                b = mod.bias
                ref.bias.copy_(gather_full_param(b, topo))
        xi = x.clone().requires_grad_()
        inp = scatter_to_sequence_parallel_region(xi, g) if sp else xi
        y = row(col(inp))
        y.backward(up[2 * rank:2 * rank + 2] if sp else up)
        xr = x.clone().requires_grad_()
        yr = ref_r(ref_c(xr))
        yr.backward(up)
        torch.testing.assert_close(y, yr[2 * rank:2 * rank + 2] if sp else yr,
                                   msg=f"sp={sp}")
        torch.testing.assert_close(xi.grad, xr.grad)
        for ref, mod in ((ref_c, col), (ref_r, row)):
            torch.testing.assert_close(_gather_grad(mod.weight, topo), ref.weight.grad)
        bias_grad = row.bias.grad.clone()
        if sp:
            assert row.bias.sequence_parallel
            torch.distributed.all_reduce(bias_grad, group=g)
        torch.testing.assert_close(bias_grad, ref_r.bias.grad)
        torch.testing.assert_close(_gather_grad(col.bias, topo), ref_c.bias.grad)
        checks += 1
    # gather_output of a strided ([gate; up]) column layer, and input_is_parallel=False
    ctx = ParallelContext(tp_group=g)
    col = ColumnParallelLinear(16, 24, parallel=ctx, gather_output=True, partition_stride=2)
    row = RowParallelLinear(24, 12, parallel=ctx, input_is_parallel=False)
    full_c = gather_full_param(col.weight, topo)
    full_r = gather_full_param(row.weight, topo)
    assert torch.equal(full_c[:12].chunk(4)[rank], col.weight[:3])  # gate block slice
    assert torch.equal(full_c[12:].chunk(4)[rank], col.weight[3:])  # up block slice
    xi = x.clone().requires_grad_()
    y = row(col(xi))
    y.backward(up)
    fc = full_c.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    yr = F.linear(F.linear(xr, fc, _gather_b(col, topo)), full_r, row.bias)
    yr.backward(up)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(xi.grad, xr.grad)
    torch.testing.assert_close(_gather_grad(col.weight, topo), fc.grad)
    checks += 1
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0
    assert row.weight.partition_dim == 1 and not hasattr(row.bias, "tensor_model_parallel")
    # vocab-parallel embedding: padded, pad rows zero, lookup equals the full table
    emb = VocabParallelEmbedding(100, 8, parallel=ctx, make_vocab_size_divisible_by=16)
    assert emb.padded_vocab_size == pad_vocab_size(100, 16, 4) == 128
    assert emb.weight.shape == (32, 8)
    table = gather_full_param(emb.weight, topo)
    assert table.shape == (100, 8)
    assert gather_full_param(emb.weight, topo, unpad=False)[100:].abs().sum() == 0
    ids = torch.randint(0, 100, (3, 5), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(emb(ids), F.embedding(ids, table))
    return checks


def _gather_b(col, topo):
    return gather_full_param(col.bias, topo)


def _gather_grad(param, topo):
    grad = param.grad.detach()
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            setattr(grad, attr, getattr(param, attr))
    return gather_full_param(grad, topo)


def _cross_entropy(rank, world):
    topo = ParallelTopology.build(tp=W)
    logits = _same(10, 6, 3, 64) * 30.0  # large logits: needs the max subtraction
    labels = torch.randint(0, 64, (6, 3), generator=torch.Generator().manual_seed(11))
    up = _same(12, 6, 3).abs()
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, 64), labels.reshape(-1), reduction="none")
    ref.reshape(6, 3).backward(up)
    shard = logits[..., 16 * rank:16 * rank + 16].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, topo.tp_group)
    loss.backward(up)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref.reshape(6, 3), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(shard.grad, full.grad[..., 16 * rank:16 * rank + 16],
                               rtol=1e-6, atol=1e-6)
    return loss.sum().item()


def test_mappings_forward_backward():
    assert all(run_distributed(_mappings, W, timeout=300))


def test_parallel_layers_match_dense():
    assert run_distributed(_layers, W, timeout=300) == [3] * W


def test_vocab_parallel_cross_entropy_matches_dense():
    losses = run_distributed(_cross_entropy, W, timeout=300)
    assert len(set(losses)) == 1


def test_shard_unshard_roundtrip_with_stride():
    full = torch.arange(48.0).reshape(12, 4)
    for stride in (1, 2, 3):
        shards = [shard_tensor(full, 0, stride, r, 2) for r in range(2)]
        assert torch.equal(unshard_tensor(shards, 0, stride), full)
    # stride 2 = [gate; up]: rank 0 holds the first half of each block
    assert torch.equal(shard_tensor(full, 0, 2, 0, 2), torch.cat([full[0:3], full[6:9]]))
    sharded, replicated = torch.nn.Parameter(full), torch.nn.Parameter(full)
    sharded.tensor_model_parallel = True
    assert param_is_not_tensor_parallel_duplicate(sharded, 1)
    assert param_is_not_tensor_parallel_duplicate(replicated, 0)
    tp_rank_1 = ParallelTopology(ParallelLayout(world_size=2, tp=2), rank=1, groups={})
    assert not param_is_not_tensor_parallel_duplicate(replicated, tp_rank_1)


def test_rng_tracker_fork_and_checkpoint_replay():
    tracker = RNGStatesTracker.for_tensor_parallel(seed=5, tp_rank=1)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must not move the global RNG"
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)
    saved = tracker.get_states()
    with tracker.fork():
        c = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), c)
    other = RNGStatesTracker.for_tensor_parallel(seed=5, tp_rank=0)
    with other.fork("default"), tracker.fork("default"):
        pass
    tracker.reset()
    with tracker.fork():
        assert torch.equal(torch.rand(4), a)
    with pytest.raises(ValueError):
        tracker.add("again", 5)

    def fn(x):
        with tracker.fork():
            x = F.dropout(x, 0.5)
        return F.dropout(x, 0.5) * 2

    x = torch.randn(64, requires_grad=True)
    state = tracker.get_states()
    gstate = torch.get_rng_state()
    y = fn(x)
    y.sum().backward()
    expected = x.grad.clone()
    x.grad = None
    tracker.set_states(state)
    torch.set_rng_state(gstate)
    y2 = checkpoint(fn, x, tracker=tracker)
    torch.rand(3)  # move both generators before the recomputation
    with tracker.fork():
        torch.rand(3)
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, expected)


def _fake_topo(tp):
    return ParallelTopology(ParallelLayout(world_size=tp, tp=tp), rank=0,
                            groups={k: None for k in ("tp", "dp", "pp", "mp", "embedding")})


@pytest.mark.parametrize("kwargs,tp,sp,fragment", [
    (dict(num_attention_heads=6, hidden_size=48), 4, False,
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (dict(num_attention_heads=8, num_query_groups=2, hidden_size=64), 4, False,
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (dict(seq_length=18), 4, True,
     "--seq-length 18 is not divisible by --tensor-model-parallel-size 4"),
])
def test_config_errors_name_the_numbers(kwargs, tp, sp, fragment):
    cfg = ModelConfig(**{"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                         "seq_length": 16, "vocab_size": 100, **kwargs})
    with pytest.raises(ConfigError) as err:
        topo = _fake_topo(tp)
        GPTModel(cfg, topo, parallel=ParallelContext.from_topology(topo, sequence_parallel=sp))
    assert fragment in str(err.value)


def test_hidden_not_divisible_by_heads():
    with pytest.raises(ConfigError, match="--hidden-size 30 is not divisible by "
                                          "--num-attention-heads 4"):
        ModelConfig(hidden_size=30, num_attention_heads=4)
