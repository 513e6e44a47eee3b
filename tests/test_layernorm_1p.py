"""Megatron's ``--apply-layernorm-1p``: norms scale by ``1 + weight`` with the weight starting
at 0, so the model computes what the standard one does with ``weight + 1``; the Hugging Face
export writes ``weight + 1``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megazero.config import ModelConfig
from megazero.convert import model_global_state
from megazero.convert.hf import megazero_to_hf
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel

BASE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                   vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0,
                   init_method_std=0.2)


@pytest.mark.parametrize("extra", [dict(), dict(normalization="RMSNorm", swiglu=True,
                                                position_embedding_type="rope",
                                                add_bias_linear=False, qk_layernorm=True)])
def test_one_plus_norms_compute_the_standard_model(extra):
    topo = ParallelTopology.single()
    std = GPTModel(replace(BASE, **extra), topo, seed=5).eval()
    onep = GPTModel(replace(BASE, **extra, apply_layernorm_1p=True), topo, seed=5).eval()
    norms = [n for n, _ in onep.named_parameters() if "layernorm.weight" in n]
    params = dict(onep.named_parameters())
    assert norms and all(float(params[n].detach().abs().max()) == 0 for n in norms)
    toks = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(onep(toks), std(toks))  # 0 + 1 == the standard init 1
        for (name, a), (_, b) in zip(std.named_parameters(), onep.named_parameters()):
            if "layernorm.weight" in name:
                a.copy_(torch.rand_like(a) + 0.5)
                b.copy_(a - 1)
        torch.testing.assert_close(onep(toks), std(toks))
    # exported, the zero-centred weights become the standard ones
    _, hf_std = megazero_to_hf(std.config, model_global_state(std, topo))
    _, hf_onep = megazero_to_hf(onep.config, model_global_state(onep, topo))
    assert hf_std.keys() == hf_onep.keys()
    for key in hf_std:
        torch.testing.assert_close(hf_onep[key], hf_std[key], rtol=1e-6, atol=1e-6)
