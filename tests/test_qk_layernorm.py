"""``--qk-layernorm`` under tensor parallelism: every gradient, the q/k norms' included, and the
global grad norm equal the one-process model's.

A TP rank holds only its heads, so its q/k norm gradient is that of its heads alone; the
gradient sync sums it over TP (with or without sequence parallelism) and the grad norm counts
the replicated weight once. The models: the Llama block (RMSNorm, GQA: 8 heads, 4
groups) and the GPT-2 block (LayerNorm: weight and bias), a head width of 12 set by
``--kv-channels`` (hidden / heads is 8 and 4), norms perturbed away from one.
"""

import torch

from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import full_model_state_dict
from megazero.tensor_parallel.context import ParallelContext
from megazero.testing import run_distributed
from megazero.testing.tiny_gpt import assert_close, batch, stage0_engine, tiny_config

CONFIG = dict(qk_layernorm=True, kv_channels=12)


def _perturb(model, topo):
    """Same perturbation of every q/k norm on every rank (they are replicated)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "q_layernorm" in name or "k_layernorm" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))


def _step(model, topo, tokens, labels):
    engine = stage0_engine([model], topo, model.sequence_parallel)
    model(tokens, labels).mean().backward()
    engine.finish_grad_sync()
    grads = full_model_state_dict(model, topo, grads=True)
    return grads, engine.step().grad_norm


def _world(rank, world):
    tokens, labels = batch()
    out = []
    for preset, leaves in (("llama", 1), ("gpt2", 2)):  # RMSNorm; LayerNorm (weight, bias)
        cfg = tiny_config(preset, **CONFIG)
        single = ParallelTopology.single()
        ref = GPTModel(cfg, single)
        _perturb(ref, single)
        ref_grads, _ = _step(ref, single, tokens, labels)  # (its step sums over this world)
        ref_norm = sum(g.double().pow(2).sum().item() for g in ref_grads.values()) ** 0.5
        qk = [n for n in ref_grads if "q_layernorm" in n or "k_layernorm" in n]
        assert len(qk) == 4 * leaves and all(ref_grads[n].shape == (12,) for n in qk)
        qk_sq = sum(ref_grads[n].pow(2).sum().item() for n in qk)
        topo = ParallelTopology.build(tp=2)
        for sp in (False, True):
            model = GPTModel(cfg, topo, parallel=ParallelContext.from_topology(
                topo, sequence_parallel=sp))
            _perturb(model, topo)
            grads, norm = _step(model, topo, tokens, labels)
            for name, g in ref_grads.items():
                assert_close(grads[name], g, f"{preset} sp={sp} grad {name}")
            out.append((preset, sp, norm, ref_norm, qk_sq))
    return out


def test_qk_norm_grads_and_grad_norm_equal_one_process_at_tp2():
    for rows in run_distributed(_world, 2, timeout=240):
        assert len(rows) == 4
        for preset, sp, norm, ref_norm, qk_sq in rows:
            # counting the q/k norms' grads twice would move the norm by this much (~3.6e-6
            # relative for the Llama, some 30x fp32's rounding of the sum); allowed: a quarter
            double = (ref_norm ** 2 + qk_sq) ** 0.5 - ref_norm
            assert double > 1e-6 * ref_norm, preset
            assert abs(norm - ref_norm) <= 0.25 * double, (preset, sp, norm, ref_norm, double)


def test_loading_with_other_qk_norms_or_head_width_names_the_flag():
    from megazero.checkpoint.load import _config_difference

    base = {"hidden_size": 64, "num_attention_heads": 8, "qk_layernorm": True}
    saved = {"model": {**base, "kv_channels": 12}}
    assert _config_difference(saved, {"model": {**base, "qk_layernorm": False,
                                                "kv_channels": 12}}) == (
        "--qk-layernorm is False but the checkpoint was saved with True (config.json)")
    assert _config_difference(saved, {"model": base}) == (
        "--kv-channels (the head width) is 8 but the checkpoint was saved with 12 (config.json)")
    # the default width given explicitly is the same width
    assert _config_difference({"model": {**base, "kv_channels": 8}}, {"model": base}) is None


def test_flags_reach_the_model_config():
    from megazero.config import load_config

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
            "--vocab-size 100 --micro-batch-size 1 --train-iters 1 --qk-layernorm "
            "--kv-channels 12").split()
    m = load_config(argv, 1).model
    assert (m.qk_layernorm, m.head_dim) == (True, 12)
    assert load_config(argv[:-3], 1).model.qk_layernorm is False


def test_head_width_counts_in_flops_and_the_step_time_model():
    """With ``--kv-channels`` the QKV, attention and output GEMMs are ``heads x kv_channels``
    wide: FLOPs by formula, the same in the run's counter and the planner's step-time model."""
    from megazero.config import load_config
    from megazero.observability.flops import gpt_flops_per_iteration
    from megazero.planner.step_time import gemm_flops_per_token

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --num-query-groups 4 "
            "--group-query-attention --swiglu --ffn-hidden-size 96 --seq-length 16 "
            "--vocab-size 128 --micro-batch-size 1 --train-iters 1 --kv-channels 12").split()
    cfg = load_config(argv, 1)
    h, q, kv, f, s, v = 64, 8 * 12, 4 * 12, 96, 16, 128
    per_layer = 2 * h * (q + 2 * kv) + 2 * 2 * s * q + 2 * q * h + 2 * h * f * 2 + 2 * f * h
    want = 3 * s * (2 * per_layer + 2 * h * v)
    assert gpt_flops_per_iteration(cfg.model, 1) == want
    assert 3 * s * sum(gemm_flops_per_token(cfg)) == want
