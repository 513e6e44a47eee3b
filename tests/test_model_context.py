"""One RecomputeConfig and one ParallelContext: validation, the flags they come from, and how a
model built from them is wired (single process, tiny models)."""

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig, load_config
from megazero.config.layout import ParallelLayout
from megazero.distributed.topology import ParallelTopology
from megazero.errors import MegazeroError
from megazero.model.gpt import GPTModel
from megazero.model.recompute import RecomputedModule, apply_recompute
from megazero.model.transformer import TransformerLayer
from megazero.pipeline.partition import build_model_chunks
from megazero.tensor_parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                          "seq_length": 8, "vocab_size": 50, **kw})


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(granularity="fulll"), "--recompute-granularity 'fulll': expected full or selective"),
    (dict(granularity="full"), "--recompute-granularity full needs --recompute-method uniform"),
    (dict(granularity="full", method="blocks"), "--recompute-method 'blocks': expected uniform"),
    (dict(granularity="full", method="uniform", num_layers=0),
     "--recompute-num-layers must be >= 1, got 0"),
    (dict(granularity="selective", modules=("mlp",)), "supports ('core_attn',)"),
    (dict(granularity="selective", modules=()), "supports ('core_attn',)"),
])
def test_recompute_config_rejects_bad_combinations(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        RecomputeConfig(**kwargs)
    assert fragment in str(err.value)


def test_recompute_flags_become_one_recompute_config():
    assert ParallelConfig().recompute == RecomputeConfig()
    assert ParallelConfig(recompute_granularity="full", recompute_method="block").recompute == \
        RecomputeConfig("full", "block", 1)  # --recompute-num-layers defaults to 1
    cfg = load_config(["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "3"])
    assert cfg.parallel.recompute == RecomputeConfig("full", "uniform", 3)
    # the flags are checked once, where the ParallelConfig is built
    with pytest.raises(ConfigError, match="--recompute-method uniform or block"):
        ParallelConfig(recompute_granularity="full")
    with pytest.raises(ConfigError, match="--recompute-num-layers must be >= 1, got 0"):
        load_config(["--recompute-num-layers", "0"])


@pytest.mark.parametrize("recompute,segments,selective", [
    (RecomputeConfig(), [], False),
    (RecomputeConfig("selective"), [], True),
    (RecomputeConfig("full", "uniform", 1), [(0, 1), (1, 2), (2, 3), (3, 4)], False),
    (RecomputeConfig("full", "uniform", 3), [(0, 3), (3, 4)], False),
    (RecomputeConfig("full", "block", 2), [(0, 1), (1, 2)], False),
    (RecomputeConfig("full", "block", 9), [(0, 1), (1, 2), (2, 3), (3, 4)], False),
])
def test_recompute_policy_on_the_model(recompute, segments, selective):
    model = GPTModel(_cfg(), ParallelTopology.single(), recompute=recompute)
    assert model.recompute == recompute
    assert model.decoder.recompute_segments == segments
    wrapped = [isinstance(layer.self_attention.core_attention, RecomputedModule)
               for layer in model.decoder.layers.values()]
    assert wrapped == [selective] * 4
    # applying another policy replaces this one (no double wrapping, no stale segments)
    apply_recompute(model, RecomputeConfig())
    assert model.decoder.recompute_segments == []
    assert not any(isinstance(layer.self_attention.core_attention, RecomputedModule)
                   for layer in model.decoder.layers.values())


def _fake_topo(tp=1, pp=1, rank=0):
    return ParallelTopology(ParallelLayout(world_size=tp * pp, tp=tp, pp=pp), rank=rank,
                            groups={k: None for k in ("tp", "dp", "pp", "mp", "embedding")})


def test_parallel_context_values():
    single = ParallelContext()
    assert (single.tp_group, single.tp_size, single.tp_rank) == (None, 1, 0)
    assert single.params_dtype == torch.float32 and single.rng_tracker is None
    # sequence parallelism is stored as it takes effect: only with more than one TP rank
    assert ParallelContext(sequence_parallel=True).sequence_parallel is False
    topo = _fake_topo(tp=4, rank=3)
    ctx = ParallelContext.from_topology(topo, sequence_parallel=True)
    assert (ctx.tp_size, ctx.tp_rank, ctx.sequence_parallel) == (4, 3, True)
    with pytest.raises(ConfigError, match="attention_backend 'fast'"):
        ParallelContext(attention_backend="fast")


def test_model_layers_share_the_one_context():
    topo = ParallelTopology.single()
    ctx = ParallelContext(params_dtype=torch.bfloat16, attention_backend="unfused")
    model = GPTModel(_cfg(hidden_dropout=0.1), topo, parallel=ctx, seed=5)
    # the chunk adds its own RNG tracker (Megatron's seed rule) and keeps everything else
    assert model.parallel.rng_tracker is model.rng_tracker is not None
    assert model.rng_tracker.get_states()["default"][0].equal(
        RNGStatesTracker.for_tensor_parallel(5, 0).get_states()["default"][0])
    layer = model.decoder.layers["2"]
    for m in (model.embedding, model.decoder, layer, layer.self_attention.core_attention):
        assert m.parallel is model.parallel
    assert layer.self_attention.core_attention.backend == "unfused"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # an explicit tracker is used as given; a context of another topology is refused
    tracker = RNGStatesTracker.for_tensor_parallel(11, 0)
    again = GPTModel(_cfg(), topo, parallel=ParallelContext(rng_tracker=tracker))
    assert again.rng_tracker is tracker
    with pytest.raises(ValueError, match="is not this topology's"):
        GPTModel(_cfg(), _fake_topo(tp=2), parallel=ParallelContext())


def test_auto_attention_without_flash_is_sdpa():
    model = GPTModel(_cfg(use_flash_attn=False), ParallelTopology.single())
    assert model.decoder.layers["0"].self_attention.core_attention.backend == "sdpa"
    model = GPTModel(_cfg(), ParallelTopology.single())
    assert model.decoder.layers["0"].self_attention.core_attention.backend == "auto"


def test_pipeline_chunks_get_their_own_trackers():
    """One context for every chunk; each chunk seeds its dropout streams from its first layer
    (``seed + 100 * pp_rank + first_layer``), so two chunks never replay the same masks."""
    topo = ParallelTopology(ParallelLayout(world_size=2, pp=2, vpp=2), rank=1,
                            groups={k: None for k in ("tp", "dp", "pp", "mp", "embedding")})
    ctx = ParallelContext.from_topology(topo)
    chunks = build_model_chunks(_cfg(), topo, 1, parallel=ctx, seed=7,
                                recompute=RecomputeConfig("selective"))
    assert [c.layer_range for c in chunks] == [(1, 2), (3, 4)]
    for c in chunks:
        want = RNGStatesTracker.for_tensor_parallel(7 + 100 + c.layer_range[0], 0)
        assert c.rng_tracker.get_states()["default"][0].equal(want.get_states()["default"][0])
        assert c.recompute == RecomputeConfig("selective")
    assert chunks[0].rng_tracker is not chunks[1].rng_tracker


def test_layers_standalone_with_the_default_context():
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 12)
    row = RowParallelLinear(12, 6, bias=False)
    x = torch.randn(3, 2, 8)
    ref = F.linear(F.linear(x, col.weight, col.bias), row.weight)
    torch.testing.assert_close(row(col(x)), ref, rtol=0, atol=0)
    emb = VocabParallelEmbedding(50, 8, make_vocab_size_divisible_by=16,
                                 parallel=ParallelContext(params_dtype=torch.float64))
    assert emb.weight.shape == (64, 8) and emb.weight.dtype == torch.float64
    ids = torch.tensor([[0, 49, 7]])
    torch.testing.assert_close(emb(ids), emb.weight[ids])


def test_dropout_without_a_tracker_names_the_fix():
    layer = TransformerLayer(_cfg(hidden_dropout=0.5, attention_dropout=0.0), 0).train()
    with pytest.raises(MegazeroError, match="rng_tracker=RNGStatesTracker.for_tensor_parallel"):
        layer(torch.randn(8, 2, 32))
    layer.eval()  # no dropout drawn: no tracker needed
    assert layer(torch.randn(8, 2, 32)).shape == (8, 2, 32)
