"""The fused elementwise operations (megazero.fusions) equal their eager references, forward
and backward, when compiled by inductor on the CPU; the model runs them where asked and gives
the eager model's numbers; ``pretrain_gpt.py`` with the fusions forced on the CPU trains the
one-process eager run's losses.

Compile time dominates (each distinct graph costs seconds on a small machine), so the cases
share few graphs: one dtype/form per function where the other adds nothing new.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ModelConfig
from megazero.fusions import (
    bias_add_residual,
    bias_gelu,
    bias_swiglu,
    compiler_available,
    rope_qk,
    use_fusion,
)
from megazero.fusions import compiled as compiled_module
from megazero.fusions import describe as describe_module
from megazero.fusions.describe import active_fusions, describe_fusions
from megazero.model import attention as attention_module
from megazero.model import mlp as mlp_module
from megazero.model import transformer as transformer_module
from megazero.model.mlp import MLP
from megazero.model.positional import RotaryEmbedding, apply_rotary
from megazero.model.transformer import TransformerLayer
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.random import RNGStatesTracker
from megazero.testing.launch import LOSS_RTOL, TINY, check, read_metrics, run_training

NO_COMPILER = compiler_available()
needs_compiler = pytest.mark.skipif(NO_COMPILER is not None, reason=str(NO_COMPILER))


def _inputs(dtype, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _close32(a, b):
    """fp32 to rounding: gradients are sums whose terms cancel (a bias grad of 7e-3 summed
    in another order differed by 2e-6), so the absolute slack scales with the tensor."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def _run(fn, args, dtype):
    """Outputs and input grads of ``fn`` on copies of ``args`` cast to ``dtype``, with a
    fixed random upstream gradient."""
    leaves = [a.detach().to(dtype).requires_grad_() for a in args]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    ups = [torch.randn(o.shape, generator=g).to(dtype) for o in out]
    torch.autograd.backward(out, ups)
    return [o.detach() for o in out] + [a.grad for a in leaves]


def _compare(fused_fn, eager_fn, args, dtype):
    """The fused form's outputs and every input's gradient equal the eager form's: in fp32 to
    rounding of reordered arithmetic. In bf16 both are held to the fp32 computation from the
    same bf16 inputs within bf16 tolerance (rtol 1.6e-2 of each value, or of the tensor's
    largest magnitude near zero): the fused kernel computes in fp32 and rounds once, eager
    rounds after every op and sums bias grads in bf16, so neither is the other's reference."""
    fused = _run(fused_fn, args, dtype)
    if dtype == torch.float32:
        for a, b in zip(fused, _run(eager_fn, args, dtype), strict=True):
            _close32(a, b)
        return
    ref = _run(eager_fn, [a.detach().to(dtype) for a in args], torch.float32)
    for got in (fused, _run(eager_fn, args, dtype)):
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a.float(), b, rtol=1.6e-2,
                                       atol=1.6e-2 * b.abs().max().item())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@needs_compiler
def test_fused_functions_equal_eager_forward_and_backward():
    """Each fused function against its eager reference; a dtype and form per graph (GELU's
    erf form in fp32, its tanh form in bf16; the model-level tests below add fp32 SwiGLU and
    full RoPE): each distinct graph costs seconds of compile time."""
    s, b, h = 8, 3, 16
    before = _graphs()
    x, bias = _inputs(torch.float32, (s, b, h), (h,))
    _compare(lambda x, y: bias_gelu(x, y, "none"), lambda x, y: F.gelu(x + y), [x, bias],
             torch.float32)
    _compare(lambda x, y: bias_gelu(x, y, "tanh"),  # --openai-gelu
             lambda x, y: F.gelu(x + y, approximate="tanh"), [x, bias], torch.bfloat16)
    x, bias = _inputs(torch.float32, (s, b, 2 * h), (2 * h,))

    def swiglu_ref(x, y):
        gate, up = (x + y).chunk(2, dim=-1)
        return F.silu(gate) * up
    _compare(bias_swiglu, swiglu_ref, [x, bias], torch.bfloat16)
    x, bias, res = _inputs(torch.float32, (s, b, h), (h,), (s, b, h))
    _compare(bias_add_residual, lambda x, y, r: r + (x + y), [x, bias, res], torch.float32)
    # RoPE against the model's apply_rotary, partial (--rotary-percent 0.5: half of each head
    # passes through)
    cos, sin = RotaryEmbedding(4, s)(s, torch.float32)
    q, k = _inputs(torch.float32, (s, b, 4, 8), (s, b, 2, 8), seed=2)
    _compare(lambda q, k: rope_qk(q, k, cos.bfloat16(), sin.bfloat16()),
             lambda q, k: (apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)),
                           apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))), [q, k],
             torch.bfloat16)
    # really compiled: a fused form that fell back to eager would compile no graph
    assert _graphs() > before


def _model(**kw) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                       **{"attention_dropout": 0.0, "hidden_dropout": 0.0,
                          "fusions_on_cpu": True, **kw})


def _layer_grads(cfg, x, training=True, seed=0, rotary=None):
    torch.manual_seed(seed)
    # the hidden-dropout masks come from the tracker's default stream, seeded alike
    tracker = RNGStatesTracker.for_tensor_parallel(123, 0)
    layer = TransformerLayer(cfg, 0, parallel=ParallelContext(rng_tracker=tracker))
    with torch.no_grad():
        for p in layer.parameters():  # non-zero biases: a dropped bias must show
            p.normal_(0, 0.2)
    layer.to(device=x.device, dtype=x.dtype).train(training)
    x = x.detach().clone().requires_grad_()
    y = layer(x, rotary)
    y.square().sum().backward()
    return [y.detach(), x.grad, *[p.grad for p in layer.parameters()]]


@needs_compiler
def test_layer_with_fusions_equals_eager_layer(monkeypatch):
    """The transformer layer (GELU MLP with biases: the unit test's fp32 graphs) with the
    fusions forced on the CPU equals the same layer unfused, output and every gradient; with
    hidden dropout in training the masks are the eager ones, so the two are bitwise equal."""
    x = torch.randn(8, 2, 16)
    fused = _model()
    plain = _model(fusions_on_cpu=False)
    assert active_fusions(fused, torch.device("cpu")) == ["bias-gelu", "bias-dropout-add"]
    assert active_fusions(plain, torch.device("cpu")) == []
    calls: list[str] = []

    def spy(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a: calls.append(name) or fn(*a))
    spy(mlp_module, "bias_gelu")
    spy(transformer_module, "bias_add_residual")
    for a, b in zip(_layer_grads(fused, x), _layer_grads(plain, x), strict=True):
        _close32(a, b)
    # the fused forms ran, in the fused layer only
    assert calls == ["bias_add_residual", "bias_gelu", "bias_add_residual"]
    # the bias-dropout-add leaves the linear as it found it (generation calls it directly)
    layer = TransformerLayer(fused, 0)
    layer(x)
    assert layer.self_attention.linear_proj.epilogue is None
    assert layer.mlp.linear_fc2.epilogue is None
    calls.clear()
    drop = dict(hidden_dropout=0.3, bias_gelu_fusion=False)
    for a, b in zip(_layer_grads(_model(**drop), x),
                    _layer_grads(_model(**drop, fusions_on_cpu=False), x), strict=True):
        assert torch.equal(a, b)
    assert calls == []  # a dropout mask drawn: nothing fused
    # eval: no mask, the bias-dropout-add fused
    for a, b in zip(_layer_grads(_model(**drop), x, training=False),
                    _layer_grads(_model(**drop, fusions_on_cpu=False), x, training=False),
                    strict=True):
        _close32(a, b)
    assert calls == ["bias_add_residual"] * 2


def test_mlp_switches(monkeypatch):
    """Megatron's flags pick the fusion per activation; on CPU only with fusions_on_cpu; on
    CUDA only where Triton is installed."""
    monkeypatch.setattr(describe_module, "triton_available", lambda: True)
    assert MLP(_model(swiglu=True, bias_gelu_fusion=False)).fuse_activation
    assert not MLP(_model(swiglu=True, bias_swiglu_fusion=False)).fuse_activation
    assert not MLP(_model(bias_gelu_fusion=False)).fuse_activation
    rope = _model(position_embedding_type="rope", swiglu=True, add_bias_linear=False)
    assert active_fusions(rope, torch.device("cpu")) == ["bias-swiglu", "rope"]
    assert active_fusions(rope, torch.device("cuda")) == ["bias-swiglu", "rope"]
    off = _model(position_embedding_type="rope", swiglu=True, bias_swiglu_fusion=False,
                 apply_rope_fusion=False, fusions_on_cpu=False)
    assert active_fusions(off, torch.device("cuda")) == ["bias-dropout-add"]
    cuda_tensor = SimpleNamespace(is_cuda=True)  # use_fusion reads only is_cuda from it
    monkeypatch.setattr(compiled_module, "triton_available", lambda: True)
    assert use_fusion(True, cuda_tensor) and not use_fusion(False, cuda_tensor)
    assert use_fusion(True, torch.zeros(1), on_cpu=True) and not use_fusion(True, torch.zeros(1))
    monkeypatch.setattr(compiled_module, "triton_available", lambda: False)
    assert not use_fusion(True, cuda_tensor)
    monkeypatch.setattr(describe_module, "triton_available", lambda: False)
    assert active_fusions(rope, torch.device("cuda")) == []
    assert "Triton is not installed" in describe_fusions(rope, torch.device("cuda"))


@needs_compiler
def test_pretrain_with_fusions_on_cpu_equals_eager(tmp_path):
    """SwiGLU with biases and RoPE: bias-SwiGLU, RoPE and bias-dropout-add compiled, at TP 2
    with sequence parallelism (fc1's bias split by columns, the output biases added to
    sequence slices) and ZeRO stage 3 with every parameter partitioned and released after
    its module's forward (a fused bias add after that forward would find the bias released:
    it must run inside it); fp32 losses equal the eager one-process ZeRO-0 run's to fp32
    rounding."""
    flags = [*TINY, "--swiglu", "--position-embedding-type", "rope", "--train-iters", "6",
             "--eval-iters", "0"]
    ref, fused = tmp_path / "eager.jsonl", tmp_path / "fused.jsonl"
    out = check(run_training([*flags, "--log-json", str(ref)]))
    assert "> fusions: none (eager on CPU" in out
    ds = tmp_path / "zero3.json"
    ds.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu":
                              "auto", "zero_optimization": {
                                  "stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0,
                                  "stage3_max_live_parameters": 0}}))
    out = check(run_training([*flags, "--fusions-on-cpu", "--deepspeed_config", str(ds),
                              "--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--log-json", str(fused)], nproc=2, timeout=300))
    assert "> fusions: bias-swiglu, bias-dropout-add, rope (torch.compile)" in out
    a, b = read_metrics(ref), read_metrics(fused)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=LOSS_RTOL, abs=0), it
        assert b[it]["grad-norm"] == pytest.approx(a[it]["grad-norm"], rel=1e-5), it


def test_megatron_fusion_flags_fill_the_model_config():
    """Megatron's --no-*-fusion flags (defaults on) and megazero's --fusions-on-cpu are real
    fields now, no longer accepted-and-dropped."""
    from megazero.config import load_config

    m = load_config(["--micro-batch-size", "1"], world_size=1).model
    assert (m.bias_gelu_fusion, m.bias_swiglu_fusion, m.bias_dropout_fusion,
            m.apply_rope_fusion, m.fusions_on_cpu) == (True, True, True, True, False)
    m = load_config(["--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
                     "--no-bias-dropout-fusion", "--no-rope-fusion", "--fusions-on-cpu"],
                    world_size=1).model
    assert (m.bias_gelu_fusion, m.bias_swiglu_fusion, m.bias_dropout_fusion,
            m.apply_rope_fusion, m.fusions_on_cpu) == (False, False, False, False, True)
    m = load_config(["--no-rope-fusion", "--apply-rope-fusion"], world_size=1).model
    assert m.apply_rope_fusion


UNFUSED = dict(bias_gelu_fusion=False, bias_swiglu_fusion=False, bias_dropout_fusion=False,
               apply_rope_fusion=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layer_fuses_by_default_and_equals_unfused(monkeypatch):
    """On CUDA the fusions run without being asked (Megatron's defaults) and the layer equals
    the unfused one: fp32 to rounding; bf16 both within bf16 tolerance of the fp32 layer."""
    calls: list[str] = []
    for module, name in ((mlp_module, "bias_gelu"), (mlp_module, "bias_swiglu"),
                         (transformer_module, "bias_add_residual"),
                         (attention_module, "rope_qk")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, fn=fn, name=name: calls.append(name)
                            or fn(*a))
    x = torch.randn(8, 2, 16, device="cuda")
    for extra, expected in ((dict(openai_gelu=True), ["bias_add_residual", "bias_gelu",
                                                      "bias_add_residual"]),
                            (dict(swiglu=True, position_embedding_type="rope"),
                             ["rope_qk", "bias_add_residual", "bias_swiglu",
                              "bias_add_residual"])):
        fused = _model(**extra, fusions_on_cpu=False)
        plain = _model(**extra, fusions_on_cpu=False, **UNFUSED)
        rope = None
        if "swiglu" in extra:
            emb = RotaryEmbedding(fused.head_dim, fused.seq_length).cuda()
            rope = emb(8, torch.float32)
        calls.clear()
        ref = _layer_grads(plain, x, rotary=rope)
        for a, b in zip(_layer_grads(fused, x, rotary=rope), ref, strict=True):
            _close32(a, b)
        assert calls == expected
        rope16 = None if rope is None else tuple(t.bfloat16() for t in rope)
        for cfg in (fused, plain):
            for a, b in zip(_layer_grads(cfg, x.bfloat16(), rotary=rope16), ref, strict=True):
                torch.testing.assert_close(a.float(), b, rtol=1.6e-2,
                                           atol=1.6e-2 * b.abs().max().item())


def test_a_fusion_that_cannot_compile_warns_once_and_runs_eagerly(monkeypatch):
    import warnings

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor: no kernel for this build")
        return run

    monkeypatch.setattr(torch, "compile", broken)

    def add_then_double(x, b):
        return (x + b) * 2

    fused = compiled_module.fuse(add_then_double)
    x, b = torch.ones(3), torch.full((3,), 2.0)
    with pytest.warns(UserWarning, match="fused add_then_double could not be compiled"):
        assert torch.equal(fused(x, b), torch.full((3,), 6.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the eager form from now on, silently
        assert torch.equal(fused(x, b), torch.full((3,), 6.0))
