"""The KV-cache path of generation computes the model's own forward: for models built by
megazero alone (no transformers needed) with RoPE (whole and partial), grouped-query attention,
query/key norms and zero-centred norms, the logits of a prompt and then one token at a time
equal the full forward's."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.generation import KVCache, forward_full, forward_with_cache
from megazero.model.gpt import GPTModel

VOCAB = 96
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=VOCAB,
            attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.2)
CASES = {
    "rope+gqa+qk-norm": dict(position_embedding_type="rope", num_query_groups=2,
                             group_query_attention=True, qk_layernorm=True,
                             normalization="RMSNorm", swiglu=True, add_bias_linear=False),
    "partial-rope+mha+layernorm-qk": dict(position_embedding_type="rope", rotary_percent=0.5,
                                          qk_layernorm=True,
                                          untie_embeddings_and_output_weights=True),
    "rope+mqa+1p": dict(position_embedding_type="rope", num_query_groups=1,
                        group_query_attention=True, apply_layernorm_1p=True, kv_channels=16),
    "learned": dict(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_logits_equal_full_forward(case):
    torch.manual_seed(0)
    mc = ModelConfig(**BASE, **CASES[case])
    model = GPTModel(mc, ParallelTopology.single(), seed=3).eval()
    with torch.no_grad():  # norms away from their init, so a skipped or doubled norm shows
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    toks = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    ref = forward_full(model, toks)
    cache = KVCache()
    parts = [forward_with_cache(model, toks[:, :7], cache)]  # the prompt, then token by token
    for i in range(7, toks.shape[1]):
        parts.append(forward_with_cache(model, toks[:, i:i + 1], cache))
    got = torch.cat(parts, dim=1)
    assert got.shape == ref.shape == (3, 20, VOCAB)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert ref.std() > 0.1  # a model whose logits carry its inputs
