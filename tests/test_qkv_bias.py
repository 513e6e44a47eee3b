"""``--add-qkv-bias``: a bias on the fused QKV linear only, with ``--disable-bias-linear``
(Qwen2's attention). Zero-initialised at every layout; under TP its rows are split with the
weight's, so TP 2 (with and without sequence parallelism) computes the TP 1 model's loss and
gradients, the bias's gradient included.

The bias starts at zero, which a wrong split would not show, so both models are loaded with the
same random global state whose QKV biases are large (they move the logits by O(1)).
Tolerance as in test_model_tp_equivalence.py: ``1e-5 * max|ref| + 1e-7`` per tensor.
"""

from __future__ import annotations

import torch

from megazero.config import load_config
from megazero.convert import load_global_state, model_global_state
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import full_model_state_dict
from megazero.tensor_parallel.context import ParallelContext
from megazero.testing import run_distributed
from megazero.testing.tiny_gpt import VOCAB, assert_close, batch, loss_and_grads, tiny_config

QKV_BIAS = "self_attention.linear_qkv.bias"


def _config():
    return tiny_config("llama", add_qkv_bias=True)  # llama: --disable-bias-linear


def test_flag_puts_a_bias_on_qkv_only():
    run = load_config(["--disable-bias-linear", "--add-qkv-bias", "--micro-batch-size", "1",
                       "--mock-data"], world_size=1)
    assert run.model.add_qkv_bias and run.model.qkv_bias and not run.model.add_bias_linear
    cfg = _config()
    assert cfg.qkv_bias and not cfg.add_bias_linear
    names = {n for n, _ in GPTModel(cfg, ParallelTopology.single()).named_parameters()}
    biases = sorted(n for n in names if n.endswith(".bias"))
    assert biases == [f"decoder.layers.{i}.{QKV_BIAS}" for i in range(cfg.num_layers)]
    assert not tiny_config("llama").qkv_bias and tiny_config("gpt2").qkv_bias


def _random_state(cfg):
    """The tp=1 model's weights with large random QKV biases."""
    single = ParallelTopology.single()
    state = model_global_state(GPTModel(cfg, single), single)
    g = torch.Generator().manual_seed(7)
    for name in state:
        if name.endswith(QKV_BIAS):
            assert torch.equal(state[name], torch.zeros_like(state[name])), name  # zero init
            state[name] = torch.randn(state[name].shape, generator=g)
    return state


def _tp2_equals_tp1(rank, world):
    torch.manual_seed(0)
    cfg = _config()
    tokens, labels = batch()
    single = ParallelTopology.single()
    state = _random_state(cfg)
    ref = GPTModel(cfg, single)
    fresh = full_model_state_dict(ref, single)
    load_global_state(ref, state, single)
    ref_loss, ref_grads = loss_and_grads(ref, single, tokens, labels)
    zero = GPTModel(cfg, single)
    load_global_state(zero, {k: (torch.zeros_like(v) if k.endswith(QKV_BIAS) else v)
                             for k, v in state.items()}, single)
    with torch.no_grad():  # the biases matter: without them the logits move by O(1)
        moved = (ref(tokens) - zero(tokens))[..., :VOCAB].abs().max().item()
    topo = ParallelTopology.build(tp=2)
    out = {"moved": moved}
    for sp in (False, True):
        model = GPTModel(cfg, topo, parallel=ParallelContext.from_topology(
            topo, sequence_parallel=sp))
        for name, w in full_model_state_dict(model, topo).items():  # layout-independent init
            assert torch.equal(w, fresh[name]), f"sp={sp} init {name}"
        local = dict(model.named_parameters())[f"decoder.layers.0.{QKV_BIAS}"]
        assert local.shape[0] * 2 == state[f"decoder.layers.0.{QKV_BIAS}"].shape[0]
        load_global_state(model, state, topo)
        loss, grads = loss_and_grads(model, topo, tokens, labels)
        assert_close(loss, ref_loss, f"sp={sp} loss")
        for name, g in grads.items():
            assert_close(g, ref_grads[name], f"sp={sp} d{name}")
        out[sp] = grads[f"decoder.layers.1.{QKV_BIAS}"].abs().max().item()
    return out


def test_tp2_equals_tp1_with_qkv_bias():
    for result in run_distributed(_tp2_equals_tp1, 2, timeout=180):
        assert result["moved"] > 0.1
        assert result[False] > 0 and result[True] > 0  # the bias gradient is really compared


def test_loading_without_the_saved_qkv_bias_names_the_flag():
    from megazero.checkpoint.load import _config_difference

    saved = {"model": {"add_bias_linear": False, "add_qkv_bias": True}}
    assert _config_difference(saved, {"model": {"add_bias_linear": False,
                                                "add_qkv_bias": False}}) == (
        "--add-qkv-bias is False but the checkpoint was saved with True (config.json)")
    # a checkpoint written before the flag existed has no key: nothing to compare
    assert _config_difference({"model": {"add_bias_linear": False}}, saved) is None
