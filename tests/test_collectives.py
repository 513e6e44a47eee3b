"""megazero.distributed.collectives: which reduce-scatter each backend gets, that every
implementation sums the same, and that a collective's own error reaches the caller instead of a
silent fallback."""

import pytest
import torch

from megazero.distributed.collectives import has_native, reduce_scatter_impl
from megazero.distributed.group_comm import CommLog, GroupComm
from megazero.testing import run_distributed


def test_reduce_scatter_impl_by_backend_and_torch():
    # auto: all-to-all on gloo (its native one is an all-reduce underneath), native elsewhere
    assert reduce_scatter_impl("auto", "gloo") == "all_to_all"
    assert reduce_scatter_impl("auto", "nccl") == "native"
    assert reduce_scatter_impl("native", "gloo", (2, 11)) == "native"
    # gloo before 2.3 had no asynchronous reduce-scatter: the next best is all-to-all
    assert not has_native("reduce_scatter_tensor", "gloo", (2, 2))
    assert reduce_scatter_impl("native", "gloo", (2, 2)) == "all_to_all"
    assert reduce_scatter_impl("all_reduce", "nccl") == "all_reduce"
    with pytest.raises(ValueError, match="reduce_scatter_impl 'ring': expected one of auto"):
        reduce_scatter_impl("ring", "gloo")


def _world(rank, world):
    import torch.distributed as dist

    out = {}
    inp = torch.arange(8, dtype=torch.float32) * (rank + 1)  # sum over 2 ranks: 3 * arange
    for impl in ("native", "all_to_all", "all_reduce"):
        comm = GroupComm(dist.group.WORLD, "dp", CommLog(), impl)
        got = torch.empty(4)
        comm.reduce_scatter(got, inp)
        h = comm.reduce_scatter(async_got := torch.empty(4), inp, async_op=True)
        h.wait()
        out[impl] = (got.tolist(), async_got.tolist(), dict(comm.log.physical))
    # a backend error (output dtype differs from the input's) surfaces, and the group keeps its
    # implementation: nothing switches to a fallback behind the caller's back
    comm = GroupComm(dist.group.WORLD, "dp", CommLog(), "native")
    try:
        comm.reduce_scatter(torch.empty(4, dtype=torch.float64), inp)
        out["dtype_error"] = None
    except RuntimeError as err:
        out["dtype_error"] = str(err)
    out["impl_after_error"] = comm.rs_impl
    # a wrong output size is refused before any collective, for every implementation
    sizes = []
    for impl in ("native", "all_to_all", "all_reduce"):
        try:
            GroupComm(dist.group.WORLD, "dp", CommLog(), impl).reduce_scatter(torch.empty(3), inp)
            sizes.append(None)
        except ValueError as err:
            sizes.append(str(err))
    out["size_errors"] = sizes
    return out


def test_reduce_scatter_implementations_and_errors():
    for rank, out in enumerate(run_distributed(_world, 2, timeout=120)):
        expected = [3.0 * x for x in range(4 * rank, 4 * rank + 4)]
        for impl, physical in (("native", "reduce_scatter"), ("all_to_all", "all_to_all"),
                               ("all_reduce", "all_reduce")):
            got, async_got, log = out[impl]
            assert got == expected and async_got == expected, impl
            # bytes per call: (N-1)/N * 32 = 16, all_reduce + slice twice that
            per_call = 32.0 if impl == "all_reduce" else 16.0
            assert log == {("dp", physical): 2 * per_call}, (impl, log)
        assert out["dtype_error"] is not None
        assert out["impl_after_error"] == "native"
        for msg in out["size_errors"]:
            assert msg is not None and "input has 8 elements, output 3" in msg
