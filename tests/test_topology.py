"""Rank arithmetic against golden tables, and real gloo groups against the arithmetic."""

import itertools

import pytest
import torch
import torch.distributed as dist

from megazero.config.layout import GROUP_KINDS, ParallelLayout
from megazero.distributed.topology import ParallelTopology
from megazero.errors import TopologyError
from megazero.testing import run_distributed


def factorisations(world):
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0:
                yield tp, pp


def check_layout(layout: ParallelLayout):
    W, tp, pp, dp = layout.world_size, layout.tp, layout.pp, layout.dp
    assert tp * pp * dp == W
    # coordinates are a bijection, tp fastest then dp then pp
    coords = [layout.coords(r) for r in range(W)]
    assert coords == [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]
    for r, c in enumerate(coords):
        assert layout.rank(*c) == r
    expected_sizes = {"tp": tp, "dp": dp, "pp": pp, "mp": tp * pp, "embedding": min(pp, 2)}
    for kind in GROUP_KINDS:
        groups = layout.all_groups(kind)
        members = sorted(itertools.chain.from_iterable(groups))
        if kind == "embedding":
            # only first and last stage ranks belong to an embedding group
            stage_ranks = [r for r in range(W) if layout.coords(r).pp in (0, pp - 1)]
            assert members == stage_ranks
        else:
            assert members == list(range(W)), kind  # every rank in exactly one group
        assert all(len(g) == expected_sizes[kind] for g in groups), kind
    for g in layout.all_groups("tp"):
        assert g == list(range(g[0], g[0] + tp))  # consecutive ranks
    for g in layout.all_groups("pp"):
        assert [layout.coords(r).pp for r in g] == list(range(pp))  # one rank per stage
        assert len({layout.coords(r)[1:] for r in g}) == 1
    for g in layout.all_groups("dp"):
        assert len({(layout.coords(r).pp, layout.coords(r).tp) for r in g}) == 1
    assert len(layout.all_groups("mp")) == dp


@pytest.mark.parametrize("world", range(1, 17))
def test_every_factorisation_small_worlds(world):
    for tp, pp in factorisations(world):
        check_layout(ParallelLayout(world, tp, pp))


@pytest.mark.parametrize("world,tp,pp", [(4096, 8, 16), (1024, 8, 8), (512, 4, 1), (96, 2, 3)])
def test_large_worlds(world, tp, pp):
    layout = ParallelLayout(world, tp, pp)
    check_layout(layout)


def test_golden_table_world_8():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.dp == 2
    assert layout.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.all_groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.all_groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == (1, 0, 1)


def test_golden_table_4096():
    layout = ParallelLayout(4096, tp=8, pp=16)
    assert layout.dp == 32
    assert layout.group_ranks("tp", 4095) == list(range(4088, 4096))
    assert layout.group_ranks("pp", 0) == [256 * p for p in range(16)]
    assert layout.group_ranks("dp", 9) == [1 + 8 * d for d in range(32)]
    assert layout.group_ranks("embedding", 3) == [3, 3 + 256 * 15]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=6, tp=4), r"not divisible by tp\*pp"),
        (dict(world_size=8, tp=0), "tp must be a positive integer"),
        (dict(world_size=-2), "world_size must be a positive integer"),
        (dict(world_size=8, pp=-1), "pp must be a positive integer"),
        (dict(world_size=4, tp=2, vpp=2), "needs pipeline parallelism"),
        (dict(world_size=4, pp=2, vpp=0), "vpp must be a positive integer"),
    ],
)
def test_bad_sizes(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        ParallelLayout(**kwargs)


def test_bad_sizes_suggest_valid():
    with pytest.raises(TopologyError) as err:
        ParallelLayout(6, tp=4)
    assert "world_size=6" in str(err.value) and "(3, 2)" in str(err.value)


def _group_membership(rank, world_size, tp, pp):
    topo = ParallelTopology.build(tp=tp, pp=pp)
    out = {}
    for kind in GROUP_KINDS:
        # each member contributes 2**rank: the sum encodes exactly who is in the group
        t = torch.tensor([float(1 << rank)], dtype=torch.float64)
        dist.all_reduce(t, group=topo.groups[kind])
        out[kind] = sorted(r for r in range(world_size) if int(t.item()) >> r & 1)
    out["coord"] = tuple(topo.coord)
    out["neighbours"] = (topo.prev_pp_rank, topo.next_pp_rank)
    return out


def test_real_groups_match_arithmetic_world_8():
    results = run_distributed(_group_membership, 8, 2, 2, timeout=120)
    layout = ParallelLayout(8, tp=2, pp=2)
    for rank, got in enumerate(results):
        for kind in GROUP_KINDS:
            assert got[kind] == layout.group_ranks(kind, rank), (rank, kind)
        assert got["coord"] == layout.coords(rank)
        c = layout.coords(rank)
        assert got["neighbours"] == (
            layout.rank((c.pp - 1) % 2, c.dp, c.tp), layout.rank((c.pp + 1) % 2, c.dp, c.tp))


def test_single_topology_needs_no_process_group():
    topo = ParallelTopology.single()
    assert (topo.tp_size, topo.pp_size, topo.dp_size) == (1, 1, 1)
    assert topo.tp_group is None and topo.is_first_stage and topo.is_last_stage
