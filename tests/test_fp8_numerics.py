"""An FP8 linear against float64 references of quantise -> GEMM -> dequantise, for each recipe
and format, forward and both gradients; delayed scaling's history; and the sharded scales
(tiles crossing ranks, SwiGLU strides) giving the unsharded values."""

from __future__ import annotations

import pytest
import torch

from megazero.errors import ConfigError
from megazero.fp8 import gemm as gemm_mod
from megazero.fp8.delayed import AmaxHistory, finish_step
from megazero.fp8.formats import E4M3, E5M2, FP8Recipe, check_device_supports
from megazero.fp8.gemm import FP8Gemm
from megazero.fp8.quantize import Shard, quantize_row_tiles, quantize_weight_blocks
from megazero.tensor_parallel.layers import LinearSavingWeight

MAX = {E4M3: 448.0, E5M2: 57344.0}


def _q64(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference quantise-dequantise of ``t`` with ``amax`` broadcast to it: the scale in fp32
    (the recipe's arithmetic), the FP8 rounding by torch's cast, the rest in float64."""
    amax = amax.float()
    quotient = torch.full_like(amax, MAX[dtype]).double() / amax.double()  # one rounding:
    scale = torch.where(amax > 0, quotient.float(), 1.0)  # float64 then float32 is exact here
    q = (t.float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() / scale.double()


def _ref_tensorwise(t, dtype):
    return _q64(t, t.abs().amax(), dtype)


def _ref_row_tiles(t, dtype, block):
    out = torch.empty(t.shape, dtype=torch.float64)
    for c in range(0, t.shape[1], block or t.shape[1]):
        tile = t[:, c:c + (block or t.shape[1])]
        out[:, c:c + tile.shape[1]] = _q64(tile, tile.abs().amax(1, keepdim=True), dtype)
    return out


def _ref_blocks(w, dtype, block):
    out = torch.empty(w.shape, dtype=torch.float64)
    for r in range(0, w.shape[0], block):
        for c in range(0, w.shape[1], block):
            b = w[r:r + block, c:c + block]
            out[r:r + block, c:c + block] = _q64(b, b.abs().amax(), dtype)
    return out


def _reference(recipe: FP8Recipe, x, w, dy, rowwise=False):
    """float64 y, dx, dw of an FP8 linear under ``recipe``."""
    fwd, bwd = recipe.forward_dtype, recipe.backward_dtype
    if recipe.recipe == "blockwise":
        qx, qdy = (_ref_row_tiles(x, fwd, recipe.block), _ref_row_tiles(dy, bwd, recipe.block))
        qw = _ref_blocks(w, fwd, recipe.block)
    elif rowwise:
        qx, qdy = _ref_row_tiles(x, fwd, None), _ref_row_tiles(dy, bwd, None)
        qw = _ref_tensorwise(w, fwd)
    else:
        qx, qdy, qw = _ref_tensorwise(x, fwd), _ref_tensorwise(dy, bwd), _ref_tensorwise(w, fwd)
    return qx @ qw.t(), qdy @ qw, qdy.t() @ qx


def _run(gemm, x, w, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = LinearSavingWeight.apply(x, w, gemm)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _data(seed=0, m=48, k=80, n=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 0] = 40.0  # an outlier that a tensorwise scale must cover
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g) * 1e-3
    return x, w, dy


CASES = [(f, r, s) for f in ("e4m3", "hybrid") for r in ("tensorwise", "blockwise")
         for s in (True, False)] + [("hybrid", "rowwise", True)]


@pytest.mark.parametrize("fmt,recipe,scaled_mm", CASES)
def test_fp8_linear_equals_float64_quantise_gemm_dequantise(fmt, recipe, scaled_mm, monkeypatch):
    monkeypatch.setattr(gemm_mod, "USE_SCALED_MM", scaled_mm)
    rowwise = recipe == "rowwise"
    rec = FP8Recipe(fmt, "tensorwise" if rowwise else recipe, block=32)
    x, w, dy = _data()
    got = _run(FP8Gemm(rec, rowwise=rowwise), x, w, dy)
    want = _reference(rec, x, w, dy, rowwise)
    for g, r, name in zip(got, want, ("y", "dx", "dw"), strict=True):
        err = (g.double() - r).abs().max() / r.abs().max()
        assert err < 2e-6, (name, float(err))
    # FP8 is not the fp32 GEMM: the quantisation shows (so the test would see it missing)
    assert (got[0] - x @ w.t()).abs().max() > 1e-3 * (x @ w.t()).abs().max()
    if fmt == "hybrid":  # e5m2 gradients differ from e4m3 ones
        e4 = _reference(FP8Recipe("e4m3", rec.recipe, block=32), x, w, dy, rowwise)
        assert not torch.equal(e4[1], want[1])


def test_delayed_scaling_uses_the_history_of_earlier_steps():
    rec = FP8Recipe("hybrid", "delayed", amax_history_len=3, amax_compute_algo="max", margin=1)
    hist = {r: AmaxHistory(3, "max", d, 1) for r, d in (("x", E4M3), ("w", E4M3), ("dy", E5M2))}
    gemm = FP8Gemm(rec, histories=hist)
    amaxes = []
    for step in range(4):
        x, w, dy = _data(step)
        x = x * (step + 1)
        scales = {r: h.scale.clone() for r, h in hist.items()}
        got = _run(gemm, x, w, dy)
        # the step's scale is the one the history gave before it: max of the window, margin 1
        if step == 0:
            assert all(float(s) == 1.0 for s in scales.values())  # no history yet: scale 1
        else:
            want_amax = max(amaxes[-3:])
            assert float(scales["x"]) == pytest.approx(448 / want_amax / 2, rel=1e-6)
        sx = scales["x"].double()
        qx = (x * scales["x"]).clamp(-448, 448).to(E4M3).double() / sx
        qw = (w * scales["w"]).clamp(-448, 448).to(E4M3).double() / scales["w"].double()
        assert (got[0].double() - qx @ qw.t()).abs().max() < 1e-5 * (qx @ qw.t()).abs().max()
        amaxes.append(float(x.abs().max()))
        finish_step(hist.values(), [])
    assert hist["x"].history.tolist() == pytest.approx(amaxes[::-1][:3])


def test_saturating_cast_under_a_stale_delayed_scale():
    rec = FP8Recipe("e4m3", "delayed")
    hist = {"x": AmaxHistory(1, "most_recent", E4M3, 0)}
    hist["x"].load(torch.tensor([1.0]))  # last step's amax 1, this step's values up to 40
    x, w, dy = _data()
    y, _, _ = _run(FP8Gemm(rec, histories=hist), x, w, dy)
    assert torch.isfinite(y).all()


def test_tiles_split_between_ranks_get_the_unsharded_scales(monkeypatch):
    """Row tiles and weight blocks cut from a shard (SwiGLU stride 2 included): the amax grids
    the ranks compute in the global tile grid, max-reduced (emulated: a first pass collects
    every rank's grid, a second returns their max), dequantise to tp 1's values."""
    from megazero.fp8 import quantize as qmod

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 96, generator=g)
    w = torch.randn(96, 64, generator=g)
    full_x, full_w = quantize_row_tiles(x, E4M3, 32), quantize_weight_blocks(w, E4M3, 32, 0, None)
    for size, stride in ((2, 1), (4, 1), (2, 2)):
        piece = 96 // size // stride
        shards = [Shard(r, size, stride, group=object()) for r in range(size)]
        cols = [sh.global_index(96 // size, x.device) for sh in shards]
        assert cols[size - 1].tolist() == [p * piece * size + (size - 1) * piece + o
                                           for p in range(stride) for o in range(piece)]
        for quant, full, take in (
                (lambda sh, c: quantize_row_tiles(x[:, c], E4M3, 32, sh),
                 full_x, lambda t, c: t[:, c]),
                (lambda sh, c: quantize_weight_blocks(w[c], E4M3, 32, 0, sh),
                 full_w, lambda t, c: t[c])):
            seen: list[torch.Tensor] = []
            monkeypatch.setattr(qmod, "reduce_amax",
                                lambda a, groups, seen=seen: seen.append(a) or a)
            for sh, c in zip(shards, cols, strict=True):
                quant(sh, c)
            total = torch.stack(seen).amax(0)
            monkeypatch.setattr(qmod, "reduce_amax", lambda a, groups, total=total: total)
            for sh, c in zip(shards, cols, strict=True):
                assert torch.equal(quant(sh, c).dequantize(), take(full.dequantize(), c))
    assert torch.allclose(full_w.dequantize().double(), _ref_blocks(w, E4M3, 32), rtol=1e-7, atol=0)


def test_mxfp8_is_refused_on_this_machine_in_one_line():
    with pytest.raises(ConfigError, match="--fp8-recipe mxfp8 needs a GPU with MXFP8"):
        check_device_supports(FP8Recipe(recipe="mxfp8"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="--fp8-format e5m2"):
        FP8Recipe(fp8_format="e5m2")


def test_apply_fp8_puts_fp8_gemms_in_the_chosen_layers_only():
    """The transform gives every linear of the FP8 layers an FP8 GEMM and leaves the
    embedding, output layer and the --first-last-layers-bf16 layers alone; the model's loss
    then moves by the quantisation (a transform that did nothing would pass every layout
    comparison)."""
    from megazero.distributed.topology import ParallelTopology
    from megazero.fp8.apply import apply_fp8, bf16_layer_indices
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel.layers import DEFAULT_GEMM
    from megazero.testing.tiny_gpt import batch, tiny_config

    torch.manual_seed(0)
    model = GPTModel(tiny_config("gpt2", num_layers=3), ParallelTopology.single())
    tokens, labels = batch()
    plain = model(tokens, labels).mean()
    bf16 = bf16_layer_indices(3, True, 1, 0)
    assert bf16 == {0}
    fp8 = apply_fp8([model], FP8Recipe("hybrid", "delayed"), bf16_layers=bf16, cp_group=None,
                    step_groups=(), device=torch.device("cpu"))
    assert (fp8.fp8_layers, fp8.bf16_layers) == ([1, 2], [0])
    names = {n for n, m in model.named_modules() if isinstance(getattr(m, "gemm", None),
                                                               FP8Gemm)}
    assert names == {f"decoder.layers.{i}.{lin}" for i in (1, 2) for lin in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
        "mlp.linear_fc2")}
    assert model.decoder.layers["0"].mlp.linear_fc1.gemm is DEFAULT_GEMM
    assert len(fp8.weights) == 8 and len(list(fp8.histories())) == 8 * 3
    quantised = model(tokens, labels).mean()
    assert abs(float(quantised.detach()) / float(plain.detach()) - 1) > 1e-6
    quantised.backward()
    fp8.finish_step()
    state = fp8.state_dict()
    assert sorted(state)[0] == "decoder.layers.1.mlp.linear_fc1.dy"
    assert all(float(h[0]) > 0 for h in state.values())  # every operand recorded an amax


def test_a_saturated_delayed_scale_is_counted_and_warned_once():
    from megazero.fp8.apply import FP8Layers

    rec = FP8Recipe("hybrid", "delayed")
    h = AmaxHistory(1, "most_recent", E4M3, 0)
    gemm = FP8Gemm(rec, histories={"x": h})
    layers = FP8Layers(rec, gemms={"decoder.layers.0.mlp.linear_fc1": gemm})
    for amax in (1.0, 1.0, 600.0, 10.0, 1e4):  # scale 448 from step 2: 600 overflows
        h.record(torch.tensor(amax))
        lines = layers.finish_step()
        if amax == 600.0:
            assert lines == [lines[0]] and "FP8 overflow: decoder.layers.0.mlp.linear_fc1.x" \
                "'s amax 600 exceeded the FP8 maximum" in lines[0]
        else:
            assert lines == []  # the first step has no history; later ones warned already
    assert (h.overflows, h.underflows) == (2, 0)  # 600 at scale 448, 1e4 at scale 44.8


def test_scales_and_casts_are_torchaos():
    """torchao's float8 building blocks (amax_to_scale, to_fp8_saturated), an independent
    implementation of the same formulas, give bitwise the scales and FP8 values of ours, power
    of two rounding included (torchao divides in float64 and rounds once to float32, which
    for one division is the float32 quotient)."""
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    from megazero.fp8.quantize import cast, scale_from_amax

    g = torch.Generator().manual_seed(5)
    for dtype in (E4M3, E5M2):
        for _ in range(200):
            x = torch.randn(64, generator=g) * 10.0 ** float(torch.randint(-8, 8, (1,),
                                                                          generator=g))
            amax = x.abs().amax()
            for pow2 in (False, True):
                ours = scale_from_amax(amax, dtype, pow2=pow2)
                theirs = float8_utils.amax_to_scale(amax, dtype, round_scales_to_power_of_2=pow2)
                assert torch.equal(ours, theirs), (dtype, pow2, float(amax))
                assert torch.equal(cast(x, ours, dtype).view(torch.uint8),
                                   float8_utils.to_fp8_saturated(x * theirs, dtype)
                                   .view(torch.uint8))
