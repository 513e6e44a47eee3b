"""The FLOPs profiler (DeepSpeed's ``flops_profiler``): one iteration counted operator by
operator on every rank, against the model FLOPs formula the log line's TFLOP/s uses."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megazero.config import ConfigError
from megazero.config.observability_schema import FlopsProfilerSettings
from megazero.observability.flops_profiler import extra_formulas, human, module_flops
from megazero.testing.launch import TINY, check, run_training


def _counted(fn) -> int:
    with FlopCounterMode(display=False, custom_mapping=extra_formulas()) as mode:
        fn()
    return mode.get_total_flops()


def test_cpu_flash_attention_counts_as_the_same_matmuls():
    """torch's registry has no formula for the CPU flash SDPA kernel; ours counts what torch
    counts for the CUDA one: the unfused attention's batched matmuls forward and backward, plus
    the score matrix the fused backward recomputes (one GEMM of its five)."""
    b, n, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for _ in range(3))

    def fused():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def unfused():
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).sum().backward()

    gemm = 2 * b * n * s * s * d
    assert _counted(unfused) == 3 * 2 * gemm
    assert _counted(fused) == 3 * 2 * gemm + gemm


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_gemm_counts_as_one_matmul_per_expert():
    """The experts' grouped GEMM (forward, input gradient, weight gradient, as
    megazero.moe.experts calls it) counts what a matmul per expert would."""
    tokens, experts, k, n = 24, 3, 16, 8
    offs = torch.tensor([8, 12, 24], dtype=torch.int32)  # 8, 4 and 12 tokens
    x, dy = torch.randn(tokens, k), torch.randn(tokens, n)
    w = torch.randn(experts, n, k)

    def grouped():
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        torch._grouped_mm(dy, w, offs=offs)
        torch._grouped_mm(dy.t(), x, offs=offs)

    def per_expert():
        for e, (lo, hi) in enumerate(zip([0, 8, 12], [8, 12, 24])):
            x[lo:hi] @ w[e].t()
            dy[lo:hi] @ w[e]
            dy[lo:hi].t() @ x[lo:hi]

    assert _counted(grouped) == _counted(per_expert) == 3 * 2 * tokens * k * n


def test_module_flops_add_up_containers_and_the_format():
    counts = {"Global": 10.0, "M": 10.0, "M.layers.0": 3.0, "M.layers.1": 4.0}
    flops = module_flops(counts, ["M", "M.layers", "M.layers.0", "M.layers.1", "M.norm"])
    assert flops == {"M": 10.0, "M.layers": 7.0, "M.layers.0": 3.0, "M.layers.1": 4.0,
                     "M.norm": 0.0}
    assert human(11.8e6, "FLOP") == "11.80 MFLOP" and human(64, "") == "64"


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="flops_profiler.profile_step: got 0"):
        FlopsProfilerSettings.from_block({"enabled": True, "profile_step": 0})
    with pytest.raises(ConfigError, match="flops_profiler.module_depth: got -2"):
        FlopsProfilerSettings.from_block({"module_depth": -2})
    s = FlopsProfilerSettings.from_block({"enabled": True})
    assert (s.profile_step, s.module_depth, s.top_modules, s.detailed) == (1, -1, 1, True)


def _report(text: str) -> dict[str, str]:
    start = text.index("megazero flops profiler")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("---"):
            break
        key, _, value = line.partition(":")
        rows[key.strip()] = value.strip()
    return rows


def _tiny_model_ratio(layers=4, h=32, s=16, vocab=256, recompute=False) -> float:
    """(hardware FLOPs / model FLOPs) of the TINY GPT: 24h² + 4sh per layer and token, 2hV
    for the logits, times 3 for forward and backward; full recomputation adds one forward of
    every layer."""
    layer = 24 * h * h + 4 * s * h
    model = 3 * (layers * layer + 2 * h * vocab)
    return (model + (layers * layer if recompute else 0)) / model


def test_one_process_counts_the_model_flops_exactly(tmp_path):
    """GQA + SwiGLU + an untied output layer: every GEMM megazero/observability/flops.py counts,
    and nothing else, is what runs."""
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"flops_profiler": {"enabled": true, "profile_step": 2, "top_modules": 2}}')
    out = check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0",
                              "--group-query-attention", "--num-query-groups", "2", "--swiglu",
                              "--untie-embeddings-and-output-weights",
                              "--deepspeed_config", str(cfg)]))
    report = _report(out)
    assert report["counted without the recomputed scores / model"] == "1.0000", report
    # fused attention's backward recomputes the scores: one fifth of its count, which the
    # report gives separately
    assert float(report["counted / model"]) > 1.001, report
    assert report["FLOPs counted on all 1 ranks"] == report["FLOPs counted on rank 0 (fwd + "
                                                            "bwd + recompute)"].split(" (")[0]
    assert out.count("megazero flops profiler") == 1
    # the decoder's layers, ranked at their depth; the detailed tree lists each layer
    assert re.search(r"depth 3: GPTModel\.decoder\.layers\.\d: [\d.]+ KFLOP|MFLOP", out), out
    assert re.search(r"^      3: [\d.]+ K, [\d.]+%; [\d.]+ MFLOP", out, re.M), out


@pytest.mark.parametrize("grouped", [False, True], ids=["expert-loop", "grouped-gemm"])
def test_dropless_moe_counts_the_model_flops_exactly(tmp_path, grouped):
    """Top-2 of 4 experts with a gated shared expert: the router, the active experts and the
    shared expert, as megazero/observability/flops.py counts an MoE layer."""
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"flops_profiler": {"enabled": true, "profile_step": 2, "detailed": false}}')
    out = check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0",
                              "--num-experts", "4", "--moe-ffn-hidden-size", "24",
                              "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size",
                              "16", "--moe-shared-expert-gate",
                              *(["--moe-grouped-gemm"] if grouped else []),
                              "--deepspeed_config", str(cfg)]))
    report = _report(out)
    assert report["counted without the recomputed scores / model"] == "1.0000", report


def test_four_ranks_with_recompute_write_the_report_to_a_file(tmp_path):
    """tp 2 x pp 2: the sum over ranks is the model's FLOPs plus one recomputed forward of each
    layer; the report goes to output_file (rank 0 only), not to stdout."""
    report_file = tmp_path / "profile" / "flops.txt"
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"flops_profiler": {
        "enabled": True, "profile_step": 2, "module_depth": 1, "detailed": False,
        "output_file": str(report_file)}}))
    out = check(run_training([*TINY, *["--tensor-model-parallel-size", "2",
                                       "--pipeline-model-parallel-size", "2"],
                              "--train-iters", "2", "--eval-iters", "0",
                              "--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--deepspeed_config", str(cfg)], nproc=4))
    assert "megazero flops profiler" not in out
    text = report_file.read_text()
    report = _report(text)
    # vocab 128 padded to 256 (a multiple of 128 x tp 2)
    assert float(report["counted without the recomputed scores / model"]) == pytest.approx(
        _tiny_model_ratio(recompute=True), abs=1e-4), report
    assert "tp 2 x pp 2" in report["layout"] and "recompute full" in report["layout"]
    assert "FLOPs counted on all 4 ranks" in report
    assert "depth 1:" in text and "depth 2:" not in text and "detailed profile" not in text
