"""The saved ranges of every tensor must tile each TP piece exactly once: a gap, an overlap or
the same range written by two ranks (a replica that should not have saved) is refused when the
index is merged, before the checkpoint becomes the latest."""

from __future__ import annotations

import pytest

from megazero.checkpoint.save_ranges import merge_index


def _entry(ranges, tp_rank=0, tp=1):
    return {"w": {"shape": [8], "dim": None, "stride": 1, "tp": tp, "vocab": None,
                  "dtype": "torch.float32", "optim": False, "piece_shape": [8],
                  "tp_rank": tp_rank, "ranges": {"weight": ranges}}}


def test_ranges_of_two_ranks_that_tile_the_piece_merge_in_order():
    merged = merge_index([_entry([["b", 4, 8]]), _entry([["a", 0, 4]])])
    assert merged["w"]["ranges"]["weight"] == [[["a", 0, 4], ["b", 4, 8]]]


@pytest.mark.parametrize("ranges", [
    [[["a", 0, 8]], [["b", 0, 8]]],  # two replicas wrote the same tensor
    [[["a", 0, 4]], [["b", 2, 8]]],  # overlap
    [[["a", 0, 4]], [["b", 5, 8]]],  # gap
    [[["a", 0, 4]], [["b", 4, 4]], [["c", 4, 8]]],  # an empty range
    [[["a", 0, 4]]],  # short
])
def test_ranges_that_do_not_tile_the_piece_are_refused(ranges):
    with pytest.raises(RuntimeError, match="do not cover its 8 elements exactly once"):
        merge_index([_entry(r) for r in ranges])
