"""Model-state bytes per rank (from real tensor storage) and data-parallel bytes moved per step
against the ZeRO formulas, stages 0-3, dp 2 and 4, fp32 and fp16, with and without offload.

Memory (Ψ parameters, N = dp, K = 12 mixed / 8 fp32): stage 0 (2+2+K)Ψ, 1 2Ψ+2Ψ+KΨ/N,
2 2Ψ+(2+K)Ψ/N, 3 (2+2+K)Ψ/N, with 2 -> 4 in fp32. Traffic (ring): 2Ψ(N-1)/N elements for
stages 0-2, 3Ψ(N-1)/N for stage 3. Both within 5%; bucket padding and Adam's per-tensor step
counters are the only extras. With the optimizer offloaded in fp32 the host also holds fp32
master weights (the device keeps the parameters it computes with): K = 12 there.
"""

from megazero.config import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.testing import run_distributed
from megazero.testing.reference import TinyLM, formula_bytes, make_batches
from megazero.zero import build_zero_optimizer
from megazero.zero.accounting import formula_comm_bytes

OPT = OptimizerConfig(lr=1e-3)
CPU = OffloadConfig(device="cpu")
VOCAB, HIDDEN = 512, 64


def _model():
    m = TinyLM(vocab=VOCAB, hidden=HIDDEN, layers=2)
    m.embedding.weight.zero_external = True
    return m


def _accounting_world(rank, world_size):
    rows = []
    batches = make_batches(2, 4, 16, VOCAB)
    for tp in (1, 2):  # dp 4, then dp 2 (the stand-in is replicated over the tp ranks)
        topo = ParallelTopology.build(tp=tp)
        for mixed in (False, True):
            prec = PrecisionConfig(fp16=mixed, initial_scale_power=8)
            for stage, offload in [(0, False), (1, False), (2, False), (3, False), (2, True),
                                   (3, True)]:
                zero = ZeroConfig(stage=stage, reduce_bucket_size=20_000,
                                  stage3_param_persistence_threshold=0,
                                  stage3_max_reuse_distance=0,
                                  offload_optimizer=CPU if offload else OffloadConfig(),
                                  offload_param=CPU if offload and stage == 3 else OffloadConfig())
                model = _model()
                psi = sum(p.numel() for p in model.parameters())
                engine = build_zero_optimizer([model], OPT, zero, prec, topo)
                for tokens, labels in batches:  # the second step is the measured one
                    engine.zero_grad()
                    engine.backward(model(tokens, labels).float().mean())
                    engine.finish_grad_sync()
                    assert engine.step().updated
                mem = engine.memory_report()
                comm = engine.comm_report()["logical_bytes"]
                moved = sum(v for k, v in comm.items() if k.startswith("dp/") and "scalar" not in k)
                rows.append(dict(dp=topo.dp_size, stage=stage, mixed=mixed, offload=offload,
                                 psi=psi, mem=mem, moved=moved,
                                 mem_formula=formula_bytes(stage, psi, topo.dp_size, mixed,
                                                           offload),
                                 comm_formula=formula_comm_bytes(stage, psi, topo.dp_size,
                                                                 2 if mixed else 4)))
    # reduce-scatter fallbacks: logical bytes stay the ring's, physical bytes show the price
    topo = ParallelTopology.build()
    for impl in ("native", "all_to_all", "all_reduce"):
        model = _model()
        engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=2), PrecisionConfig(), topo,
                                      reduce_scatter_impl=impl)
        engine.zero_grad()
        engine.backward(model(*batches[0]).float().mean())
        engine.step()
        rep = engine.comm_report()
        rows.append(dict(impl=impl, logical=rep["logical_bytes"]["dp/reduce_scatter"],
                         physical=rep["physical_bytes"]))
    return rows


def test_memory_and_traffic_match_zero_formulas():
    rows = run_distributed(_accounting_world, 4, timeout=400)[0]
    assert len(rows) == 27
    fallbacks = {r["impl"]: r for r in rows[24:]}
    logical = fallbacks["native"]["logical"]
    assert fallbacks["native"]["physical"]["dp/reduce_scatter"] == logical
    assert fallbacks["all_to_all"]["logical"] == logical
    assert fallbacks["all_to_all"]["physical"]["dp/all_to_all"] == logical
    assert fallbacks["all_reduce"]["logical"] == logical
    assert fallbacks["all_reduce"]["physical"]["dp/all_reduce"] == 2 * logical
    for r in rows[:24]:
        what = f"dp={r['dp']} stage={r['stage']} mixed={r['mixed']} offload={r['offload']}"
        mem, total = r["mem"], r["mem"]["total"]
        assert abs(total / r["mem_formula"] - 1) < 0.05, (what, total, r["mem_formula"])
        assert abs(r["moved"] / r["comm_formula"] - 1) < 0.05, (what, r["moved"],
                                                                 r["comm_formula"])
        assert mem["padding_elements"] < 0.01 * r["psi"], what
        k = 12 if r["mixed"] or r["offload"] else 8  # offloaded fp32 keeps host masters
        optimizer_bytes = k * r["psi"] / (r["dp"] if r["stage"] else 1)
        if r["offload"]:  # optimizer state (masters + moments) sits in the host column
            assert mem["bytes"]["optimizer"]["device"] == 0, what
            assert abs(mem["bytes"]["optimizer"]["offload"] / optimizer_bytes - 1) < 0.05, what
        else:
            assert mem["offload_total"] == 0, what
            assert abs(mem["bytes"]["optimizer"]["device"] / optimizer_bytes - 1) < 0.05, what
