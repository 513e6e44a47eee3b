"""The startup banner reports the model's own parameter count, the same at every layout: TP
slices count once, tensors every TP rank holds whole count once per model (not once per TP rank),
vocabulary pad rows and the tied embedding's second copy not at all."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.config import ModelConfig
from megazero.pipeline.partition import build_model_chunks
from megazero.testing import run_distributed
from megazero.topology import ParallelTopology
from megazero.training import local_parameter_share

# vocab 1100 pads to 1152 at tp 1, 1280 at tp 2, 1536 at tp 4: the pad rows differ by layout
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=1100, make_vocab_size_divisible_by=128)
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (1, 2)]


def _reference() -> int:
    """Single-process count without the pad rows."""
    topo = ParallelTopology.single()
    chunks = build_model_chunks(MODEL, topo)
    n = sum(p.numel() for c in chunks for p in c.parameters())
    pad = sum((p.padded_vocab_size - p.vocab_size) * p.shape[1] for c in chunks
              for p in c.parameters() if hasattr(p, "padded_vocab_size"))
    return n - pad


def _counts(rank: int, world: int) -> list[int]:
    torch.manual_seed(0)
    out = []
    for tp, pp in LAYOUTS:
        topo = ParallelTopology.build(tp=tp, pp=pp)
        share = torch.tensor([local_parameter_share(build_model_chunks(MODEL, topo), topo)],
                             dtype=torch.float64)
        dist.all_reduce(share)
        out.append(round(share.item() / topo.dp_size))
    return out


def test_parameter_count_is_the_same_at_every_layout():
    want = _reference()
    results = run_distributed(_counts, 4, timeout=180)
    for counts in results:
        assert counts == [want] * len(LAYOUTS), (counts, want)
