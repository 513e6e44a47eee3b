"""The dynamic loss-scaler state machine against hand-computed sequences (no processes)."""

import pytest

from megazero.config import PrecisionConfig
from megazero.zero.loss_scaler import LossScaleError, LossScaler


def _run(scaler, flags):
    out = []
    for overflow in flags:
        scaler.update(overflow)
        out.append((scaler.scale, scaler.cur_hysteresis))
    return out


def test_window_and_hysteresis_sequence():
    cfg = PrecisionConfig(fp16=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    s = LossScaler.from_config(cfg)
    assert s.dynamic and s.scale == 16.0
    flags = [False, False, False, True, True, False, True, False, False, False, True]
    expected = [(16, 2), (16, 2), (32, 2),  # grows after 3 clean steps
                (32, 1), (16, 1),  # first overflow spends hysteresis, second halves
                (16, 1),  # clean step does not refill hysteresis (not consecutive)
                (8, 1),  # so the next overflow halves at once
                (8, 1), (8, 1), (16, 2),  # 3 clean steps since the overflow: grow, refill
                (16, 1)]
    assert _run(s, flags) == expected


def test_consecutive_hysteresis_refills_on_clean_step():
    cfg = PrecisionConfig(fp16=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2,
                          consecutive_hysteresis=True)
    s = LossScaler.from_config(cfg)
    flags = [False, False, False, True, True, False, True]
    expected = [(16, 2), (16, 2), (32, 2), (32, 1), (16, 1), (16, 2), (16, 1)]
    assert _run(s, flags) == expected


def test_min_scale_floor_then_error():
    cfg = PrecisionConfig(fp16=True, initial_scale_power=2, hysteresis=1, min_loss_scale=1.0)
    s = LossScaler.from_config(cfg)
    assert _run(s, [True, True]) == [(2, 1), (1, 1)]
    with pytest.raises(LossScaleError, match="minimum loss scale"):
        s.update(True)


def test_static_scale_never_changes():
    s = LossScaler.from_config(PrecisionConfig(fp16=True, loss_scale=128.0))
    assert not s.dynamic
    assert _run(s, [True, False, True]) == [(128.0, 2)] * 3


def test_bf16_and_fp32_do_not_scale():
    for cfg in (PrecisionConfig(bf16=True), PrecisionConfig()):
        s = LossScaler.from_config(cfg)
        assert s.scale == 1.0 and not s.dynamic


def test_state_dict_roundtrip():
    cfg = PrecisionConfig(fp16=True, initial_scale_power=5, loss_scale_window=2)
    s = LossScaler.from_config(cfg)
    _run(s, [True, False, False])
    t = LossScaler.from_config(cfg)
    t.load_state_dict(s.state_dict())
    assert _run(t, [False, True, True]) == _run(s, [False, True, True])
