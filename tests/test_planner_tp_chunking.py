"""What --tp-comm-overlap's sequence chunks cost in GEMM efficiency: a GEMM of M rows takes time
proportional to M + M0 (the cluster's ``gemm_half_rate_rows``), so the overlap's three chunked
GEMMs per linear pair and pass take (tp - 1) M0 / (M + M0) of their time more; priced as a
step-time term of its own, counted with the exposed TP time the tools print, checked against
the formula written out by hand (no timing); and bench/chunked_gemm.py's fit of M0."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megazero.planner.cluster import load_cluster
from megazero.planner.comm_overlap import exposed_comm
from megazero.planner.presets import preset_argv
from megazero.planner.search import _config
from megazero.planner.tp_cost import overlap_chunking_seconds
from megazero.testing.step_time_terms import RATE, B, H, L, S, cluster, terms

ROOT = Path(__file__).resolve().parents[1]
TP2_SP = ["--tensor-model-parallel-size=2", "--sequence-parallel"]
M0 = 16.0


@pytest.mark.parametrize("recompute", [False, True])
def test_chunking_term_is_the_hand_formula(recompute):
    """tp 2, S B = 64 rows, M0 = 16: per layer and micro-batch two pairs of three chunked GEMMs
    (five with full recompute: the column and row forward run twice), each 16 / 80 of a GEMM
    more; the communication term does not move."""
    full = (["--recompute-granularity=full", "--recompute-method=uniform"] if recompute
            else [])
    flags = [*TP2_SP, "--tp-comm-overlap", *full]
    cl = cluster(gemm_half_rate_rows=M0)
    got = terms(flags, cl=cl)
    mb, tp, rows = 8, 2, S * B
    gemm = B * S * 24 * H * H / 4 / tp / RATE  # one of a pair's GEMMs: 1/4 of the layer's
    chunked = 5 if recompute else 3
    want = L * mb * 2 * chunked * gemm * (tp - 1) * M0 / (rows + M0)
    assert got["TP overlap chunking"] == pytest.approx(want, rel=1e-12)
    assert got["tensor parallel"] == terms(flags, cl=cluster())["tensor parallel"]


def test_chunking_sits_on_each_micro_batch_path():
    """PP 2 (2 layers a stage, 8 micro-batches): the bubble, (p - 1) micro-batches of the
    stage's compute and exposed communication, grows by one micro-batch's chunking."""
    flags = [*TP2_SP, "--tp-comm-overlap", "--pipeline-model-parallel-size=2"]
    with_m0 = terms(flags, world=4, cl=cluster(gemm_half_rate_rows=M0))
    without = terms(flags, world=4, cl=cluster())
    chunking = with_m0["TP overlap chunking"]
    assert chunking == pytest.approx(2 * 8 * 2 * 3 * B * S * 24 * H * H / 4 / 2 / RATE
                                     * M0 / (S * B + M0), rel=1e-12)
    assert with_m0["pipeline bubble"] - without["pipeline bubble"] == pytest.approx(
        chunking / 8, rel=1e-9)


def test_no_chunking_cost_without_the_overlap_or_chunks():
    cl = cluster(gemm_half_rate_rows=M0)
    assert "TP overlap chunking" not in terms(TP2_SP, cl=cl)  # overlap off: whole GEMMs
    assert "TP overlap chunking" not in terms([*TP2_SP, "--tp-comm-overlap"], cl=cluster())
    assert overlap_chunking_seconds(1.0, 4096, 1, 128.0, 1.0) == 0.0  # one chunk
    assert overlap_chunking_seconds(1.0, 4096, 8, 128.0) == pytest.approx(3 * 7 * 128 / 4224)


def test_llama2_70b_on_1024_h100s_overlap_still_pays_after_chunking():
    """Llama-2 70B, TP 8, PP 8, DP 16, SP, mb 1, gbs 1024, seq 4096 on h100-80gb-nvlink
    (M0 = 128): the overlap's chunks cost 10 layers x 64 micro-batches x 1.5 forward linear
    GEMM times x 7 x 128 / (4096 + 128); the exposed TP time with the overlap, chunking
    included, stays below the plain one (the README's numbers)."""
    argv = [*preset_argv("llama2-70b"), "--bf16", "--seq-length", "4096",
            "--micro-batch-size", "1", "--global-batch-size", "1024",
            "--distributed-backend", "nccl"]
    cfg = _config(argv, ["--tensor-model-parallel-size=8", "--pipeline-model-parallel-size=8",
                         "--sequence-parallel"], 1024)
    cl = load_cluster("h100-80gb-nvlink")
    assert cl.gemm_half_rate_rows == 128
    ex = exposed_comm(cfg, cl)
    h, kv, f = 8192, 8 * 128, 28672  # 64 heads of 128 in 8 KV groups, SwiGLU
    forward = 2 * (h * (h + 2 * kv) + h * h + 3 * h * f) * 4096 / 8 / (989e12 * 0.65)
    want = 10 * 64 * 1.5 * forward * 7 * 128 / (4096 + 128)
    assert ex.tp_chunking == pytest.approx(want, rel=1e-9)
    assert ex.tp_plain == pytest.approx(0.899, abs=5e-4)
    assert ex.tp_overlap == pytest.approx(0.572, abs=5e-4)
    assert ex.tp_chunking == pytest.approx(0.278, abs=5e-4)
    assert ex.tp_overlap < ex.tp_plain and ex.step_overlap < ex.step_plain
    (line,) = ex.lines(cfg)
    assert "0.278 s the chunked GEMMs' lost efficiency" in line


def _bench():
    spec = importlib.util.spec_from_file_location("chunked_gemm", ROOT / "bench" /
                                                  "chunked_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_fit_recovers_m0_from_model_ratios():
    bench = _bench()
    points = [(m, tp, bench.chunked_ratio(m, tp, 100.0)) for m in (512, 4096)
              for tp in (2, 4, 8)]
    assert points[2][2] == pytest.approx((512 + 800) / 612)
    assert bench.fit_m0(points) == pytest.approx(100.0, rel=1e-6)
    assert bench.fit_m0([(512, 2, 1.0), (512, 4, 1.0)]) == pytest.approx(0.0, abs=1e-6)


def test_bench_smoke_run_on_cpu(tmp_path):
    """Tiny shapes, one repeat: the table's JSON has every GEMM and chunk count, and the
    model's ratios come from the fitted M0 (no timing asserted)."""
    bench = _bench()
    out = tmp_path / "cg.json"
    bench.main(["--device", "cpu", "--tokens", "64", "--hidden", "128", "--ffn", "256",
                "--heads", "4", "--groups", "2", "--repeats", "1", "--warmup", "0",
                "--tp", "2", "4", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and len(data["load_average"]) == 3
    assert list(data["gemms"]) == ["qkv fwd", "proj fwd", "proj dgrad", "fc1 fwd", "fc2 fwd",
                                   "fc2 dgrad"]
    fc1 = data["gemms"]["fc1 fwd"]
    assert (fc1["k"], fc1["n"], fc1["rows"]) == (128, 2 * 256 // 8, 64)
    assert data["gemms"]["qkv fwd"]["n"] == (4 + 2 * 2) * 32 // 8
    m0 = data["fit"]["m0_rows"]
    for g in data["gemms"].values():
        assert set(g["tp"]) == {"2", "4"}
        for c, v in g["tp"].items():
            assert v["model_ratio"] == pytest.approx((64 + int(c) * m0) / (64 + m0))
