"""Model-state bytes from the planner equal the ZeRO engine's measured bytes exactly.

Measured: ``engine.memory_report()`` (storage bytes of parameters, gradients, fp32 masters and
AdamW moments, by device / host placement) after an optimizer step, on every rank of a 4-rank
gloo world at tp1 x dp4, tp2 x dp2 (sequence parallel; and --qk-layernorm), pp2 x dp2 and
tp2 x pp2, for ZeRO stages 0-3, optimizer/parameter offload and fp32 / bf16 / fp16. dp 8 runs
the engine's own buffers in one process with an 8-way dp group stand-in (building them and the
optimizer step do not communicate).
"""

from dataclasses import replace

import torch

from megazero.config import OffloadConfig, load_config
from megazero.planner.model_states import model_state_report
from megazero.planner.shapes import meta_chunks, shape_topology
from megazero.testing import run_distributed

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--vocab-size 100 --micro-batch-size 1 --train-iters 1").split()
# tp2 x dp2 with --qk-layernorm: the q/k norms wait for their TP sum in buckets of their own
LAYOUTS = [(1, 1, []), (2, 1, ["--sequence-parallel"]), (1, 2, []), (2, 2, []),
           (2, 1, ["--qk-layernorm"])]
PRECISIONS = ([], ["--bf16"], ["--fp16"])
CPU = OffloadConfig(device="cpu")


def _cases(pp):
    for stage in (0, 1, 2, 3):
        for offload in ((False, True) if stage else (False,)):
            yield stage, offload


def _zero(cfg, stage, offload):
    return replace(cfg.zero, stage=stage, reduce_bucket_size=1500, sub_group_size=1000,
                   stage3_param_persistence_threshold=100,
                   offload_optimizer=CPU if offload else OffloadConfig(),
                   offload_param=CPU if offload and stage == 3 else OffloadConfig())


def _predict(cfg, topo):
    chunks = meta_chunks(cfg, shape_topology(cfg.layout(), topo.pp_rank, topo.dp_rank,
                                             topo.tp_rank))
    rep = model_state_report(chunks, cfg.zero, cfg.precision, dp=topo.dp_size,
                             dp_rank=topo.dp_rank, tp=topo.tp_size, pp=topo.pp_size,
                             sequence_parallel=cfg.parallel.sequence_parallel)
    return rep.bytes, rep.padding_elements


def _world(rank, world_size):
    from megazero.distributed.topology import ParallelTopology
    from megazero.training.builders import build_model_and_optimizer

    rows = []
    for tp, pp, extra in LAYOUTS:
        topo = ParallelTopology.build(tp=tp, pp=pp)
        for prec in PRECISIONS:
            argv = BASE + [f"--tensor-model-parallel-size={tp}",
                           f"--pipeline-model-parallel-size={pp}"] + extra + prec
            base = load_config(argv, world_size)
            for stage, offload in _cases(pp):
                cfg = replace(base, zero=_zero(base, stage, offload))
                _, engine = build_model_and_optimizer(cfg, topo, torch.device("cpu"))
                engine.zero_grad()
                assert engine.step().updated
                mem = engine.memory_report()
                rows.append((f"tp{tp} pp{pp} {prec} stage{stage} offload={offload} rank{rank}",
                             (mem["bytes"], mem["padding_elements"]), _predict(cfg, topo)))
    return rows


def test_model_states_equal_engine_bytes_dp1_2_4():
    results = run_distributed(_world, 4, timeout=600)
    n = 0
    for rows in results:
        for what, measured, predicted in rows:
            assert measured == predicted, what
            n += 1
    assert n == 4 * 3 * (7 + 7 + 7 + 7 + 7)


def test_model_states_equal_engine_bytes_dp8(monkeypatch):
    """dp 8 in one process: the engine's buffers built for each of 8 dp ranks."""
    from megazero.distributed.topology import ParallelTopology
    from megazero.training.builders import build_model_and_optimizer
    from megazero.zero import optimizer as zopt

    real = zopt.Comms.from_topology
    state = {}

    def comms_with_dp8(topo, rs_impl="native", shared_memory="auto"):
        c = real(topo, rs_impl, "backend")  # a pretended group of 8 shares no memory
        c.dp.size, c.dp.rank = 8, state["rank"]
        return c

    monkeypatch.setattr(zopt.Comms, "from_topology", staticmethod(comms_with_dp8))
    topo = ParallelTopology.single()
    for prec in PRECISIONS:
        base = load_config(BASE + prec, 8)
        for stage, offload in _cases(1):
            cfg = replace(base, zero=_zero(base, stage, offload))
            for rank in (0, 7):
                state["rank"] = rank
                _, engine = build_model_and_optimizer(cfg, topo, torch.device("cpu"))
                engine.masters.step(1.0)  # creates the AdamW moments; no communication
                mem = engine.memory_report()
                chunks = meta_chunks(cfg, shape_topology(cfg.layout(), 0, rank, 0))
                rep = model_state_report(chunks, cfg.zero, cfg.precision, dp=8, dp_rank=rank)
                assert (mem["bytes"], mem["padding_elements"]) == (
                    rep.bytes, rep.padding_elements), (prec, stage, offload, rank)
