"""The startup banner reports the model's own parameter count, the same at every layout: TP
slices count once, tensors every TP rank holds whole count once per model (not once per TP rank),
vocabulary pad rows and the tied embedding's second copy not at all."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.config import ModelConfig
from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.partition import build_model_chunks
from megazero.testing import run_distributed
from megazero.training.banner import local_parameter_share

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


def test_banner_counts_the_model_under_zero_3():
    """ZeRO-3 partitions every parameter over data-parallel ranks (and keeps nothing whole
    under the persistence threshold): the banner still counts the model, not the partition."""
    import json
    import re

    from megazero.testing.launch import TINY, check, run_training

    def banner_count(out):
        return int(re.search(r"M parameters \(([\d,]+)\)", out).group(1).replace(",", ""))

    one = banner_count(check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0"])))
    ds = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ds, f)
    z3 = banner_count(check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0",
                                          "--deepspeed_config", f.name], nproc=2)))
    assert z3 == one, (z3, one)


def test_banner_names_the_moe_layout():
    """The MoE line, the active parameters beside the total (a token passes the top-k of each
    layer's experts), and context parallelism inside the layout's product."""
    import re

    from megazero.testing.launch import TINY, check, run_training

    out = check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0",
                              "--num-experts", "4", "--moe-router-topk", "1",
                              "--moe-expert-capacity-factor", "1.5",
                              "--context-parallel-size", "2", "--attention-dropout", "0"],
                             nproc=2))
    assert ("> moe: 4 experts, top-1 (aux_loss), expert parallel 1, allgather dispatcher, "
            "capacity factor 1.5") in out, out
    assert "> world 2 (gloo): tp 1 x cp 2 x pp 1 x dp 1, vpp 1" in out, out
    total, active = (int(x.replace(",", "")) for x in re.search(
        r"M parameters \(([\d,]+)\), [\d.]+M active per token \(([\d,]+), top-1\)",
        out).groups())
    # 4 layers x 4 experts of hidden 32 -> 128 -> 32 with biases; 3 of 4 idle per token
    per_expert = 2 * 32 * 128 + 128 + 32
    assert total - active == 4 * 3 * per_expert, (total, active)


def test_banner_names_the_architecture():
    from megazero.testing.launch import TINY, check, run_training

    out = check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0",
                              "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                              "--swiglu", "--group-query-attention", "--num-query-groups", "2",
                              "--qk-layernorm", "--disable-bias-linear",
                              "--untie-embeddings-and-output-weights"]))
    line = next(x for x in out.splitlines() if x.startswith("> architecture:"))
    assert line == ("> architecture: RMSNorm, RoPE, SwiGLU MLP 64, 2 query groups, head width 8, "
                    "no biases, QK layernorm, untied output layer"), line
    out = check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0"]))
    assert ("> architecture: LayerNorm, learned positions, GELU MLP 128, multi-head attention, "
            "head width 8, biases, tied embeddings") in out, out
