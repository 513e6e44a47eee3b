"""Counter-based, shard-only parameter initialisation (megazero.model.init)."""

from __future__ import annotations

import math

import pytest
import torch

from megazero.config import ModelConfig
from megazero.model import init as mi
from megazero.tensor_parallel.layers import (
    mark_vocab_parallel,
    set_tensor_model_parallel_attributes,
)
from megazero.tensor_parallel.utils import shard_tensor


def _n(key: str, depth_scaled: bool = False) -> mi.InitSpec:
    return mi.InitSpec("normal", depth_scaled, key)


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100,
                seq_length=32, init_method_std=0.02)
    base.update(kw)
    return ModelConfig(**base)


def test_vectorised_hash_matches_plain_python_definition():
    keys = [0, 1, 123456789, (1 << 63) - 1]
    idx = [0, 1, 2, 1000, 10**9, (1 << 40) + 3]
    for key in keys:
        got = mi.splitmix64(key, torch.tensor(idx, dtype=torch.int64))
        want = [mi.splitmix64_reference(key, i) for i in idx]
        assert [int(g) & ((1 << 64) - 1) for g in got] == want


def test_distribution_and_scaled_std():
    cfg = _config()
    w = mi.full_init_tensor(_n("decoder.layers.0.mlp.linear_fc1.weight"), (1024, 1024), cfg, 7)
    assert abs(w.mean().item()) < 1e-4
    assert w.std().item() == pytest.approx(0.02, rel=0.01)
    proj = mi.full_init_tensor(_n("decoder.layers.0.self_attention.linear_proj.weight", True),
                               (1024, 256), cfg, 7)
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.01)
    # roughly normal: about 68.3% within one std
    inside = (w.abs() < 0.02).float().mean().item()
    assert inside == pytest.approx(0.6827, abs=0.005)
    assert torch.equal(mi.full_init_tensor(mi.InitSpec("ones", key="ln.weight"), (8,),
                                           cfg, 7), torch.ones(8))
    assert torch.equal(mi.full_init_tensor(mi.InitSpec("zeros", key="fc1.bias"), (8,),
                                           cfg, 7), torch.zeros(8))


def test_parameters_layers_and_seeds_differ():
    cfg = _config()
    a = mi.full_init_tensor(_n("decoder.layers.0.mlp.linear_fc1.weight"), (16, 16), cfg, 7)
    assert torch.equal(a, mi.full_init_tensor(_n("decoder.layers.0.mlp.linear_fc1.weight"),
                                              (16, 16), cfg, 7))
    for name, seed in [("decoder.layers.1.mlp.linear_fc1.weight", 7),
                       ("decoder.layers.0.mlp.linear_fc2.weight", 7),
                       ("decoder.layers.0.mlp.linear_fc1.weight", 8)]:
        b = mi.full_init_tensor(_n(name), (16, 16), cfg, seed)
        assert (a != b).float().mean() > 0.99


def _shard(full: tuple[int, int], dim: int, stride: int, tp: int) -> torch.nn.Parameter:
    shape = list(full)
    shape[dim] //= tp
    p = torch.nn.Parameter(torch.empty(shape))
    set_tensor_model_parallel_attributes(p, dim, stride)
    return p


@pytest.mark.parametrize("dim,stride", [(0, 1), (0, 2), (1, 1)])
def test_shards_are_bitwise_slices_of_full_tensor(dim, stride):
    cfg = _config()
    name, full_shape = "decoder.layers.2.mlp.linear_fc1.weight", (48, 40)
    full = mi.full_init_tensor(_n(name), full_shape, cfg, 3)
    for tp in (2, 4, 8):
        for rank in range(tp):
            p = _shard(full_shape, dim, stride, tp)
            mi.init_parameter_(p, _n(name), cfg, 3, rank, tp)
            assert torch.equal(p.data, shard_tensor(full, dim, stride, rank, tp)), (tp, rank)


def test_vocab_shards_with_padding():
    cfg = _config()
    name, vocab, padded, h = "embedding.word_embeddings.weight", 100, 128, 8
    full = mi.full_init_tensor(_n(name), (vocab, h), cfg, 3)
    full = torch.cat([full, torch.zeros(padded - vocab, h)])
    for tp in (1, 2, 4):
        for rank in range(tp):
            p = torch.nn.Parameter(torch.empty(padded // tp, h))
            mark_vocab_parallel(p, vocab, padded)
            mi.init_parameter_(p, _n(name), cfg, 3, rank, tp)
            assert torch.equal(p.data, full.chunk(tp)[rank])


def test_shard_init_draws_only_shard_elements(monkeypatch):
    """Count the generator's outputs: a rank computes exactly its shard's elements (so a
    shard's init costs the shard, not the full tensor; timing it is bench/init_scaling.py's)."""
    cfg = _config()
    counted = []
    real = mi.normal_at
    monkeypatch.setattr(mi, "normal_at", lambda key, idx, ws=None: counted.append(idx.numel())
                        or real(key, idx, ws))
    p = _shard((4096, 512), 0, 2, 8)
    mi.init_parameter_(p, _n("decoder.layers.0.mlp.linear_fc1.weight"), cfg, 1, 3, 8)
    assert sum(counted) == p.numel()
    assert max(counted) <= mi.CHUNK_ELEMENTS


# --- the init rule belongs to the layer ---------------------------------------------------------

def _gpt(**kw):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    cfg = _config(num_layers=2, **kw)
    return cfg, GPTModel(cfg, ParallelTopology.single(), seed=5)


def _expected_rule(name: str) -> tuple[str, bool]:
    """The reference table (Megatron's init): norms ones/zeros, biases zero, output
    projections N(0, std/sqrt(2L)), other weights N(0, std)."""
    if "layernorm" in name:
        return ("ones" if name.endswith("weight") else "zeros"), False
    if name.endswith("bias"):
        return "zeros", False
    return "normal", name.endswith(("linear_proj.weight", "linear_fc2.weight"))


@pytest.mark.parametrize("kw", [{}, {"normalization": "RMSNorm", "swiglu": True,
                                     "untie_embeddings_and_output_weights": True}])
def test_gpt_layers_declare_the_megatron_rules(kw):
    cfg, model = _gpt(**kw)
    for name, p in model.named_parameters():
        spec = mi.spec_of(p, name)
        assert (spec.kind, spec.depth_scaled) == _expected_rule(name), name
        assert spec.key == name  # the declared keys spell the global names
        rows = getattr(p, "vocab_size", None) or p.shape[0]  # vocab pad rows are zero
        want = mi.full_init_tensor(spec, (rows, *p.shape[1:]), cfg, 5)
        assert torch.equal(p.data[:rows], want), name
        assert not p.data[rows:].any()
    proj = model.decoder.layers["0"].mlp.linear_fc2.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.2)


def test_renaming_or_wrapping_a_submodule_keeps_the_weights(monkeypatch):
    from megazero.model import transformer

    _, plain = _gpt()
    want = {n: p.detach().clone() for n, p in plain.named_parameters()}
    orig = transformer.TransformerLayer.__init__

    def renamed(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        mlp = self.mlp
        del self.mlp
        self.feed_forward = torch.nn.Sequential(mlp)  # renamed and wrapped
        attn = self.self_attention
        del self.self_attention
        self.attn = attn

    monkeypatch.setattr(transformer.TransformerLayer, "__init__", renamed)
    _, other = _gpt()
    got = dict(other.named_parameters())
    assert "decoder.layers.1.feed_forward.0.linear_fc2.weight" in got
    assert len(got) == len(want)
    for name, p in got.items():
        ref = name.replace("feed_forward.0.", "mlp.").replace(".attn.", ".self_attention.")
        assert torch.equal(p.data, want[ref]), name


def test_a_parameter_without_a_declared_rule_is_an_error(monkeypatch):
    from megazero.errors import MegazeroError
    from megazero.model import mlp

    monkeypatch.setattr(mlp, "declare_linear", lambda layer, **kw: layer)
    with pytest.raises(MegazeroError, match="linear_fc1.weight declares no init rule"):
        _gpt()


@pytest.mark.parametrize("dim,stride,vocab", [(0, 2, False), (1, 1, False), (0, 1, True)])
def test_flat_ranges_match_the_shard(dim, stride, vocab):
    """Any flat range of a shard (what ZeRO-3 materialises from a meta model) holds the same
    values as the shard initialised whole."""
    cfg, tp, rank = _config(), 4, 2
    spec = _n("decoder.layers.1.mlp.linear_fc1.weight", depth_scaled=True)
    if vocab:
        p = torch.nn.Parameter(torch.empty(128 // tp, 24, device="meta"))
        mark_vocab_parallel(p, 100, 128)
    else:
        p = _shard((48, 40), dim, stride, tp).to("meta")
        set_tensor_model_parallel_attributes(p, dim, stride)
    whole = torch.empty(p.shape)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "vocab_size"):
        if hasattr(p, attr):
            setattr(whole, attr, getattr(p, attr))
    mi.init_parameter_(whole, spec, cfg, 9, rank, tp)
    flat = whole.reshape(-1)
    for lo, hi in [(0, flat.numel()), (7, 300), (flat.numel() - 5, flat.numel())]:
        out = torch.empty(hi - lo)
        mi.fill_flat_range_(out, p, spec, cfg, 9, lo, rank, tp)
        assert torch.equal(out, flat[lo:hi]), (lo, hi)
