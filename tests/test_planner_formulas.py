"""Planner numbers against published formulas: DeepSpeed's estimate_zero{2,3} (hand-computed
values), the 18 (fp32 gradients) or 16 (bf16 gradients) bytes/parameter of mixed-precision
Adam without ZeRO for Llama-2 7B, Megatron's
per-layer activation bytes (and the measured saved bytes of a real layer), the pipeline's
in-flight micro-batches (1F1B: pp on the first stage; interleaved: pv + p - 1 chunks)."""

import pytest
import torch

from megazero.config import ConfigError, load_config
from megazero.planner.activations import inflight_chunk_forwards, layer_bytes
from megazero.planner.cluster import load_cluster
from megazero.planner.deepspeed_compat import zero2_mem_needs, zero3_mem_needs
from megazero.planner.estimate import estimate
from megazero.planner.presets import LLAMA_FLAGS, preset_argv
from megazero.testing.activation_memory import measure_saved_bytes, megatron_layer_activation_bytes


def test_deepspeed_zero2_formula_hand_values():
    # 1e9 params, 8 GPUs on 1 node. No offload: GPU 2P + 18P/8 = 4.25e9; host 4P*8*1.5 = 48e9.
    assert zero2_mem_needs(10**9, 8, 1, cpu_offload=False) == (48 * 10**9, 4_250_000_000)
    # offload: GPU 2P; host P * max(4*8, 16) * 1.5 = 48e9
    assert zero2_mem_needs(10**9, 8, 1, cpu_offload=True) == (48 * 10**9, 2 * 10**9)
    # 2 nodes x 4: offload host P * max(32, 16) * 1.5; 1 GPU: max(4, 16) = 16 -> 24e9
    assert zero2_mem_needs(10**9, 1, 1, cpu_offload=True) == (24 * 10**9, 2 * 10**9)


def test_deepspeed_zero3_formula_hand_values():
    p, big = 10**9, 5 * 10**7  # largest layer 50M params -> 200 MB
    # no offload: GPU 4*50M + 18P/8 = 0.2e9 + 2.25e9; host (zero_init) 50M*4*8*1.5 = 2.4e9
    assert zero3_mem_needs(p, big, 8, 1, cpu_offload=False, cpu_offload_params=False) == (
        2_400_000_000, 2_450_000_000, 200_000_000)
    # offload optimizer + params, 2 nodes: GPU 0.2e9; host P * 18 / 2 * 1.5 = 13.5e9
    assert zero3_mem_needs(p, big, 8, 2, True, True) == (13_500_000_000, 200_000_000,
                                                         200_000_000)
    # offload optimizer only, 1 node x 4: GPU 0.2e9 + 2P/4 = 0.7e9; host P * 16 * 1.5 = 24e9
    assert zero3_mem_needs(p, big, 4, 1, True, False) == (24 * 10**9, 700_000_000, 200_000_000)


def test_llama2_7b_mixed_precision_no_zero_is_16_or_18_bytes_per_param():
    """bf16 weights, fp32 gradients (Megatron's default for bf16: accumulated and reduced in
    fp32), fp32 masters and two moments: 2 + 4 + 12 = 18 bytes/param; with bf16 gradients
    (DeepSpeed's data_types.grad_accum_dtype "bf16") the classic 16."""
    import json
    import tempfile

    for extra, per_param in (({}, 18), ({"data_types": {"grad_accum_dtype": "bf16"}}, 16)):
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(extra, f)
            f.flush()
            cfg = load_config(preset_argv("llama2-7b") + "--bf16 --micro-batch-size 1 "
                              f"--train-iters 1 --deepspeed_config {f.name}".split(), 8)
        w = estimate(cfg, load_cluster("h100-80gb-nvlink")).worst
        psi = w.numel
        assert 6.73e9 < psi < 6.75e9
        states = (w.items["weights"] + w.items["gradients"]
                  + w.items["fp32 masters + Adam moments"])
        assert abs(states / psi - per_param) < 1e-3
        assert 6.73e9 * per_param < states < 6.75e9 * per_param


@pytest.mark.parametrize("tp,sp,selective", [(1, False, False), (4, False, False),
                                             (4, True, False), (4, True, True)])
def test_layer_bytes_is_megatron_formula_for_gpt2(tp, sp, selective):
    argv = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
            f"--bf16 --tensor-model-parallel-size {tp} --micro-batch-size 2 --train-iters 1")
    cfg = load_config(argv.split() + (["--sequence-parallel"] if sp else []), tp)
    assert layer_bytes(cfg, 2, tp, selective=selective) == megatron_layer_activation_bytes(
        128, 2, 256, 8, tp, sp, selective)


def test_layer_bytes_against_a_measured_layer():
    """The real gpt2 layer and a llama-style layer (SwiGLU, GQA, RoPE, no biases; LayerNorm,
    since CPU RMSNorm is composite, see megazero/planner/activations.py), also with q/k norms
    and a head width of 24 (--qk-layernorm --kv-channels 24), unfused attention, bf16, one
    rank: measured saved bytes within 5% of the prediction (gpt2 0.1%, llama 2.8%, with q/k
    norms 3.3%; leaving their inputs out of the prediction would read +2.3%)."""
    from megazero.config import ModelConfig
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel.context import ParallelContext

    llama = dict(num_query_groups=2, normalization="LayerNorm", group_query_attention=True)
    qk = dict(llama, qk_layernorm=True, kv_channels=24)
    for preset, extra in (("gpt2", {}), ("llama", llama), ("llama", qk)):
        m = ModelConfig.preset(preset, num_layers=1, hidden_size=128, num_attention_heads=8,
                               seq_length=64, vocab_size=100, **extra)
        model = GPTModel(m, ParallelTopology.single(), parallel=ParallelContext(
            params_dtype=torch.bfloat16, attention_backend="unfused"))
        layer = model.decoder.layers["0"]
        x = torch.randn(64, 2, 128, dtype=torch.bfloat16, requires_grad=True)
        rotary = model.rotary(64, x.dtype) if model.rotary is not None else None
        measured = measure_saved_bytes(layer, x, rotary)
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in (
            ("num_layers", 1), ("hidden_size", 128), ("num_attention_heads", 8),
            ("seq_length", 64), ("micro_batch_size", 2), ("train_iters", 1))]
        argv += ["--bf16"] + (LLAMA_FLAGS.split() + ["--attention-dropout=0.1",
                                                     "--hidden-dropout=0.1",
                                                     "--num-query-groups=2",
                                                     "--group-query-attention",
                                                     "--normalization=LayerNorm"]
                              if preset == "llama" else [])
        argv += ["--qk-layernorm", "--kv-channels=24"] if "qk_layernorm" in extra else []
        cfg = load_config(argv, 1)
        predicted = layer_bytes(cfg, 2, 1)
        assert abs(measured / predicted - 1) < 0.05, (preset, extra, measured, predicted)


def test_inflight_microbatches_from_the_schedule():
    assert inflight_chunk_forwards(4, None, 8, 0) == 4  # 1F1B first stage: pp
    assert inflight_chunk_forwards(4, None, 8, 3) == 1
    assert inflight_chunk_forwards(4, None, 2, 0) == 2  # fewer micro-batches than stages
    for p, v in ((2, 2), (4, 2), (4, 3)):  # interleaved: pv + p - 1 chunk-forwards
        assert inflight_chunk_forwards(p, v, 4 * p, 0) == p * v + p - 1


def test_impossible_layout_gives_the_runs_message():
    with pytest.raises(ConfigError, match="not divisible by --tensor-model-parallel-size 3"):
        load_config(preset_argv("llama2-7b") + ["--tensor-model-parallel-size", "3"], 6)
