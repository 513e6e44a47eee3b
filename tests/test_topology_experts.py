"""The expert grid (etp, ep, edp, pp; megatron-core's order) against golden rank tables, and
its pipeline groups equal to the dense grid's."""

from __future__ import annotations

import pytest

from megazero.topology import ParallelLayout, TopologyError

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
