"""Tiny GPT configurations, a fixed batch, and loss/gradient helpers for comparing a parallel
model with the single-process one."""

from __future__ import annotations

import torch

from megazero.config import ModelConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.tensor_parallel import full_model_state_dict
from megazero.zero import build_zero_optimizer

VOCAB, SEQ, BATCH = 100, 16, 2


def tiny_config(preset: str, **kw) -> ModelConfig:
    base = dict(num_layers=2, seq_length=SEQ, vocab_size=VOCAB, attention_dropout=0.0,
                hidden_dropout=0.0)
    if preset == "llama":
        base.update(hidden_size=64, num_attention_heads=8, num_query_groups=4)
    else:
        base.update(hidden_size=32, num_attention_heads=4)
    return ModelConfig.preset(preset, **{**base, **kw})


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, labels


def stage0_engine(chunks, topo, sequence_parallel):
    """The gradient sync training uses without ZeRO: data-parallel average, and the sums of
    sequence-parallel parameters' grads over the tensor-parallel group."""
    return build_zero_optimizer(chunks, OptimizerConfig(), ZeroConfig(stage=0),
                                PrecisionConfig(), topo, sequence_parallel=sequence_parallel)


def loss_and_grads(model, topo, tokens, labels):
    engine = stage0_engine([model], topo, model.sequence_parallel)
    loss = model(tokens, labels)
    loss.mean().backward()
    engine.finish_grad_sync()
    return loss.detach(), full_model_state_dict(model, topo, grads=True)


def assert_close(got, ref, what, rel=1e-5, atol=1e-7):
    """``|got - ref| <= rel * max|ref| + atol`` over the tensor; returns the max abs error."""
    err = (got - ref).abs().max().item()
    bound = rel * ref.abs().max().item() + atol
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"
    return err
