"""The planner counts the 1-bit optimizers' state byte for byte as the engine holds it.

Measured: ``engine.memory_report()`` after two steps with the compressed phase from step 2
(OneBitAdam and OneBitLamb ``freeze_step`` 1, ZeroOneAdam ``var_freeze_step`` 1), on every
rank of a 4-rank gloo world at dp 4 and tp2 x dp2 (sequence parallel), fp32 and bf16, and
in one process (dp 1: OneBitAdam keeps no error buffers, ZeroOneAdam keeps them sized for one
rank). Predicted: :func:`megazero.planner.model_states.model_state_report`.
"""

from dataclasses import replace

import torch

from megazero.config import load_config
from megazero.planner.model_states import model_state_report
from megazero.planner.onebit_states import ACCUMULATOR, SCALARS, SERVER, WORKER
from megazero.planner.shapes import meta_chunks, shape_topology
from megazero.testing import run_distributed

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 100 --micro-batch-size 1 --train-iters 2").split()
OPTIMIZERS = (("onebitadam", dict(freeze_step=1), 1000),
              ("zerooneadam", dict(var_freeze_step=1), 1000),
              ("onebitlamb", dict(freeze_step=1), 10**9))  # Lamb takes whole parameters


def _measure_and_predict(base, topo, kind, params, sub_group):
    from megazero.training.builders import build_model_and_optimizer

    cfg = replace(base, optimizer=replace(base.optimizer, optimizer=kind, **params),
                  zero=replace(base.zero, stage=0, sub_group_size=sub_group))
    _, engine = build_model_and_optimizer(cfg, topo, torch.device("cpu"))
    for _ in range(2):  # warm-up step, then a compressed one
        engine.zero_grad()
        assert engine.step().updated
    measured = engine.memory_report()["bytes"]
    chunks = meta_chunks(cfg, shape_topology(cfg.layout(), topo.pp_rank, topo.dp_rank,
                                             topo.tp_rank))
    extras: dict[str, int] = {}
    predicted = model_state_report(chunks, cfg.zero, cfg.precision, dp=topo.dp_size,
                                   dp_rank=topo.dp_rank, tp=topo.tp_size, pp=topo.pp_size,
                                   sequence_parallel=cfg.parallel.sequence_parallel,
                                   optimizer=cfg.optimizer, extras=extras).bytes
    return measured, predicted, extras


def _world(rank, world_size):
    from megazero.distributed.topology import ParallelTopology

    rows = []
    for tp, extra in ((1, []), (2, ["--sequence-parallel"])):
        topo = ParallelTopology.build(tp=tp)
        for prec in ([], ["--bf16"]):
            base = load_config(BASE + [f"--tensor-model-parallel-size={tp}"] + extra + prec,
                               world_size)
            for kind, params, sub in OPTIMIZERS:
                rows.append((f"tp{tp} {prec} {kind} rank{rank}",
                             *_measure_and_predict(base, topo, kind, params, sub)))
    return rows


def test_onebit_state_equals_engine_bytes_dp2_4():
    n = 0
    for rows in run_distributed(_world, 4, timeout=300):
        for what, measured, predicted, extras in rows:
            assert measured == predicted, what
            assert extras[WORKER] > 0 and extras[SERVER] > 0, what
            n += 1
    assert n == 4 * 2 * 2 * 3


def test_onebit_state_equals_engine_bytes_dp1():
    from megazero.distributed.topology import ParallelTopology

    base = load_config(BASE, 1)
    topo = ParallelTopology.single()
    got = {}
    for kind, params, sub in OPTIMIZERS:
        measured, predicted, extras = _measure_and_predict(base, topo, kind, params, sub)
        assert measured == predicted, kind
        got[kind] = extras
    assert WORKER not in got["onebitadam"] and WORKER not in got["onebitlamb"]
    assert got["zerooneadam"][WORKER] == got["zerooneadam"][SERVER]  # one rank: same size
    assert got["zerooneadam"][ACCUMULATOR] > 0 and got["onebitlamb"][SCALARS] > 0
