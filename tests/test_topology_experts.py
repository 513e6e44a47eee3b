"""The expert grid (etp, ep, edp, pp; megatron-core's order) against golden rank tables, and
its pipeline groups equal to the dense grid's."""

from __future__ import annotations

import pytest

from megazero.config.layout import ParallelLayout
from megazero.errors import TopologyError

GOLDEN = {
    # (world, tp, pp, ep, etp): {kind: every group}
    (8, 2, 1, 2, 1): {
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "etp": [[r] for r in range(8)],
    },
    (8, 2, 1, 2, 2): {
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    (8, 1, 2, 2, 1): {
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 2, 2, 4, 1): {
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[r] for r in range(8)],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (4, 1, 1, 1, 1): {"ep": [[r] for r in range(4)], "edp": [[0, 1, 2, 3]]},
    (16, 2, 2, 2, 1): {
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    },
}


@pytest.mark.parametrize("key", list(GOLDEN))
def test_expert_groups_match_the_golden_tables(key):
    world, tp, pp, ep, etp = key
    layout = ParallelLayout(world, tp, pp, ep=ep, etp=etp)
    for kind, groups in GOLDEN[key].items():
        assert layout.all_groups(kind) == groups, kind


@pytest.mark.parametrize("world,tp,pp,ep,etp", [(8, 2, 2, 2, 1), (64, 4, 4, 4, 2),
                                                (48, 2, 3, 8, 1), (1024, 8, 4, 16, 2)])
def test_expert_grid_shares_the_pipeline_groups_and_round_trips(world, tp, pp, ep, etp):
    layout = ParallelLayout(world, tp, pp, ep=ep, etp=etp)
    assert layout.edp == world // (etp * ep * pp)
    for r in range(world):
        e = layout.expert_coords(r)
        assert layout.expert_rank(*e) == r
        assert e.pp == layout.coords(r).pp  # the two grids agree on the stage
    edp_sizes = {len(g) for g in layout.all_groups("edp")}
    assert edp_sizes == {layout.edp}
    # every rank is in exactly one group of each kind
    for kind in ("ep", "etp", "edp"):
        flat = sorted(r for g in layout.all_groups(kind) for r in g)
        assert flat == list(range(world))


def test_an_expert_grid_that_does_not_tile_the_world_is_one_line_naming_the_flags():
    with pytest.raises(TopologyError) as err:
        ParallelLayout(8, 2, 1, ep=3)
    msg = str(err.value)
    assert "\n" not in msg and "--expert-model-parallel-size 3" in msg and "[1, 2, 4, 8]" in msg


# With context parallelism the expert grid is carved from the same world (megatron-core):
# edp = world / (etp ep pp) counts the CP ranks, and expert parallelism may span CP ranks.
GOLDEN_CP = {
    # (world, tp, cp, pp, ep): {kind: every group}
    (8, 2, 2, 1, 2): {
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],  # the dp_cp groups: EP == TP
    },
    (8, 2, 2, 1, 4): {
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (4, 1, 2, 1, 2): {
        "cp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "dp_cp": [[0, 1, 2, 3]],
        "tp_cp": [[0, 1], [2, 3]],
        "ep": [[0, 1], [2, 3]],  # the CP ranks of one sequence
        "edp": [[0, 2], [1, 3]],
    },
    (4, 1, 2, 1, 4): {"ep": [[0, 1, 2, 3]], "edp": [[r] for r in range(4)]},
    (8, 1, 2, 2, 2): {
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
}


@pytest.mark.parametrize("key", list(GOLDEN_CP))
def test_expert_groups_with_context_parallelism_match_the_golden_tables(key):
    world, tp, cp, pp, ep = key
    layout = ParallelLayout(world, tp, pp, cp=cp, ep=ep)
    assert layout.edp == world // (ep * pp)
    for kind, groups in GOLDEN_CP[key].items():
        assert layout.all_groups(kind) == groups, kind


@pytest.mark.parametrize("key", list(GOLDEN_CP))
def test_expert_grads_with_context_parallelism_are_scaled_to_the_mean_loss(key):
    """Experts share the dense buffers exactly when their edp group is the dp x cp group;
    otherwise their gradient (summed over edp, divided there by edp) is pre-multiplied by
    edp / (dp cp): each CP rank back-propagates CP times its share of the loss."""
    import torch

    from megazero.distributed.topology import ParallelTopology
    from megazero.moe.grads import experts_need_own_group, scale_expert_grads

    world, tp, cp, pp, ep = key
    layout = ParallelLayout(world, tp, pp, cp=cp, ep=ep)
    for rank in range(world):
        topo = ParallelTopology(layout, rank, {})
        own = experts_need_own_group(topo)
        assert own == (layout.group_ranks("edp", rank) != layout.group_ranks("dp_cp", rank))
        p = torch.nn.Parameter(torch.ones(2))
        scale_expert_grads([p], topo)
        p.sum().backward()
        assert p.grad.tolist() == [layout.edp / (layout.dp * cp)] * 2
