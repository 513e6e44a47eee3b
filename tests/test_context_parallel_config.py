"""The cp axis of the topology (megatron-core's rank order tp, cp, dp, pp) against golden rank
tables, real gloo groups against the arithmetic, and the context-parallel flags' one-line
errors, raised while the config is built (before any process group exists)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megazero.config import load_config
from megazero.config.layout import ParallelLayout
from megazero.distributed.topology import ParallelTopology
from megazero.errors import ConfigError
from megazero.testing import run_distributed

# World 16, tp 2, cp 2, dp 2, pp 2: rank = tp + 2 (cp + 2 (dp + 2 pp)), as megatron-core's
# RankGenerator(order="tp-cp-ep-dp-pp") builds them.
GOLDEN_16 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "mp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
}
# World 8, tp 2, cp 2, dp 2 (the notes' example): CP [0,2],[1,3]..., DPxCP [0,2,4,6],[1,3,5,7].
GOLDEN_8 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
}


@pytest.mark.parametrize("layout,golden", [
    (ParallelLayout(16, tp=2, pp=2, cp=2), GOLDEN_16), (ParallelLayout(8, tp=2, cp=2), GOLDEN_8)])
def test_golden_rank_tables(layout, golden):
    for kind, groups in golden.items():
        assert layout.all_groups(kind) == groups, kind
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(c.pp, c.dp, c.tp, layout.cp_of(r)) == r


def test_cp_one_is_the_old_layout():
    for world, tp, pp in ((8, 2, 2), (12, 3, 1), (6, 1, 3)):
        old, new = ParallelLayout(world, tp, pp), ParallelLayout(world, tp, pp, cp=1)
        for kind in ("tp", "dp", "pp", "mp", "embedding"):
            assert old.all_groups(kind) == new.all_groups(kind)
        assert new.all_groups("dp_cp") == new.all_groups("dp")
        assert new.all_groups("cp") == [[r] for r in range(world)]


def _groups(rank, world):
    topo = ParallelTopology.build(tp=2, cp=2)
    return (topo.cp_rank, topo.grad_rank, topo.grad_size, topo.dp_size,
            dist.get_process_group_ranks(topo.cp_group),
            dist.get_process_group_ranks(topo.grad_group))


def test_built_groups_match_the_arithmetic():
    got = run_distributed(_groups, 8, timeout=120)
    layout = ParallelLayout(8, tp=2, cp=2)
    for r, (cp_rank, grad_rank, grad_size, dp_size, cp_ranks, grad_ranks) in enumerate(got):
        assert cp_rank == layout.cp_of(r) and (grad_size, dp_size) == (4, 2)
        assert cp_ranks == layout.group_ranks("cp", r)
        assert grad_ranks == layout.group_ranks("dp_cp", r)
        assert grad_ranks.index(r) == grad_rank


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 "
        "--attention-dropout 0 --mock-data --train-iters 1 --lr 1e-3")


@pytest.mark.parametrize("extra,world,needle", [
    ("--context-parallel-size 3", 6, "--seq-length 64 is not divisible by 2 x "
     "--context-parallel-size = 6"),
    ("--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel "
     "--seq-length 36", 8, "--seq-length 36 / --context-parallel-size 2 = 18 is not divisible"),
    ("--context-parallel-size 4 --cp-comm-type a2a --group-query-attention "
     "--num-query-groups 2", 4, "--cp-comm-type a2a splits the heads"),
    ("--context-parallel-size 2 --attention-dropout 0.1", 2,
     "--attention-dropout 0.1 with --context-parallel-size 2"),
    ("--context-parallel-size 3", 4, "world size 4 is not divisible by tp*cp*pp"),
])
def test_bad_input_is_one_line_before_launch(extra, world, needle):
    with pytest.raises(ConfigError) as err:
        load_config(f"{BASE} {extra}".split(), world)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


def test_cp_divides_the_data_parallel_size():
    cfg = load_config(f"{BASE} --context-parallel-size 2 --tensor-model-parallel-size 2".split(),
                      8)
    assert (cfg.parallel.cp, cfg.parallel.dp, cfg.layout().cp) == (2, 2, 2)
    assert cfg.parallel.cp_comm_type == "p2p"
