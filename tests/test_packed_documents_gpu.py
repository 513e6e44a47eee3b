"""On a GPU with flash-attn, packed documents run flash-attn's variable-length kernel: its
per-token loss equals each document run alone (bf16, within bf16 rounding), and equals the
SDPA-mask path's. The CPU suite checks the mask path (test_packed_documents.py) and the
documents' boundaries here."""

from __future__ import annotations

import pytest
import torch

from megazero.model.packed import document_ids, document_starts


def test_document_starts_lay_documents_end_to_end():
    docs = document_ids(torch.tensor([[3, 0, 4, 5], [0, 6, 0, 7]]), 0)
    assert document_starts(docs).tolist() == [0, 2, 4, 5, 7, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_varlen_equals_the_mask_path():
    pytest.importorskip("flash_attn")
    from megazero.model.packed import _flash_varlen, packed_mask
    from megazero.tensor_parallel.context import ParallelContext

    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, n, d = 64, 2, 4, 32
    q, k, v = (torch.randn(s, b, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    tokens = torch.randint(1, 50, (b, s), device="cuda", generator=g)
    tokens[0, [9, 30]] = 0
    tokens[1, [3, 40, 41]] = 0
    docs = document_ids(tokens, 0)
    got = _flash_varlen(q, k, v, docs)
    pos = torch.arange(s, device="cuda")
    mask = packed_mask(docs, docs, pos, pos)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3).float() for t in (q, k, v)), attn_mask=mask)
    want = want.permute(2, 0, 1, 3).reshape(s, b, n * d)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert ParallelContext().attention_backend == "auto"
