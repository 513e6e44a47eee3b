"""The fallbacks behind :mod:`megazero.compat` compute what the newer torch API computes."""

import pytest
import torch

import megazero.model.attention as attention
from megazero import compat


@pytest.mark.skipif(not compat.SDPA_HAS_GQA, reason="the native GQA path needs torch >= 2.5")
def test_sdpa_gqa_fallback_equals_native(monkeypatch):
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 8, 2, 8, 2, 16
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
    native = attention.CoreAttention._sdpa(q, k, v, 0.0)
    monkeypatch.setattr(attention, "SDPA_HAS_GQA", False)
    repeated = attention.CoreAttention._sdpa(q, k, v, 0.0)
    torch.testing.assert_close(repeated, native, rtol=1e-6, atol=1e-6)
    assert repeated.shape == (s, b, heads * d)


def test_single_tensor_collectives_resolve():
    import torch.distributed as dist

    assert compat.all_gather_into_tensor in (getattr(dist, "all_gather_single", None),
                                             dist.all_gather_into_tensor)
    assert compat.TORCH_VERSION >= (2, 4)
