"""Learning-rate schedules against hand-computed values."""

import math

import pytest

from megazero.config import ConfigError, OptimizerConfig
from megazero.optim.lr_scheduler import LRScheduler, build_lr_function


def _sched(train_iters=100, **kw):
    groups = [{"lr": None}, {"lr": None, "lr_mult": 0.5}]
    return groups, LRScheduler.from_config(groups, OptimizerConfig(**kw), train_iters)


def test_megatron_linear_with_warmup():
    groups, s = _sched(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_iters=110,
                       lr_decay_style="linear")
    assert groups[0]["lr"] == 0.0  # first step of warm-up runs at 0, as in Megatron
    s.step(5)
    assert groups[0]["lr"] == pytest.approx(5e-4)
    assert groups[1]["lr"] == pytest.approx(2.5e-4)  # lr_mult
    s.step(5)
    assert s.get_lr() == pytest.approx(1e-3)
    s.step(50)  # step 60: half-way through decay (10 -> 110)
    assert s.get_lr() == pytest.approx(1e-4 + 0.5 * 9e-4)
    s.step(50)
    assert s.get_lr() == pytest.approx(1e-4)
    s.step(7)  # past decay: min_lr
    assert s.get_lr() == pytest.approx(1e-4)


def test_megatron_cosine_and_constant():
    f = build_lr_function(OptimizerConfig(lr=2.0, min_lr=0.0, lr_warmup_iters=0,
                                          lr_decay_style="cosine"), train_iters=100)
    assert f(0) == pytest.approx(2.0)
    assert f(25) == pytest.approx(1.0 + math.cos(math.pi / 4))  # 0.5*(cos(pi/4)+1)*2
    assert f(50) == pytest.approx(1.0)
    assert f(100) == pytest.approx(0.0, abs=1e-12)
    g = build_lr_function(OptimizerConfig(lr=3e-4, lr_warmup_iters=4, lr_decay_style="constant"),
                          train_iters=None)
    assert [g(i) for i in (0, 2, 4, 1000)] == pytest.approx([0.0, 1.5e-4, 3e-4, 3e-4])


def test_deepspeed_warmup_lr_log_and_linear():
    f = build_lr_function(OptimizerConfig(scheduler_type="WarmupLR", scheduler_params={
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100}), None)
    # step k uses last_batch_iteration = k - 1; -1 -> min lr; log warm-up log(it+1)/log(100)
    assert f(0) == 0.0
    assert f(1) == pytest.approx(0.0)  # log(1) = 0
    assert f(10) == pytest.approx(1e-3 * math.log(10) / math.log(100))  # = 0.5e-3
    assert f(10) == pytest.approx(5e-4)
    assert f(101) == pytest.approx(1e-3)
    g = build_lr_function(OptimizerConfig(scheduler_type="WarmupLR", scheduler_params={
        "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
        "warmup_type": "linear"}), None)
    assert g(0) == pytest.approx(1e-4)
    assert g(6) == pytest.approx(1e-4 + 9e-4 * 5 / 10)
    assert g(50) == pytest.approx(1e-3)


def test_deepspeed_warmup_decay_and_cosine():
    f = build_lr_function(OptimizerConfig(scheduler_type="WarmupDecayLR", scheduler_params={
        "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}),
        train_iters=110)  # total_num_steps derived from --train-iters
    assert f(6) == pytest.approx(5e-4)
    assert f(11) == pytest.approx(1e-3)  # it = 10: (110 - 10) / 100
    assert f(61) == pytest.approx(5e-4)  # it = 60: 50 / 100
    assert f(111) == pytest.approx(0.0)
    c = build_lr_function(OptimizerConfig(lr=2e-3, scheduler_type="WarmupCosineLR",
                                           scheduler_params={
        "total_num_steps": 110, "warmup_num_steps": 10, "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.0, "warmup_type": "linear"}), None)
    assert c(0) == 0.0  # WarmupCosineLR starts at 0 before its first step
    assert c(6) == pytest.approx(2e-3 * (0.1 + 0.9 * 0.5))
    # it = 59: real step 50 of 100 -> cos ratio 0.5
    assert c(60) == pytest.approx(1e-3)
    assert c(110) == pytest.approx(0.0, abs=1e-12)


def test_state_dict_resumes_and_errors():
    groups, s = _sched(lr=1e-3, lr_warmup_iters=10, lr_decay_style="cosine")
    s.step(37)
    state = s.state_dict()
    groups2, s2 = _sched(lr=1e-3, lr_warmup_iters=10, lr_decay_style="cosine")
    s2.load_state_dict(state)
    assert groups2[0]["lr"] == groups[0]["lr"] and s2.num_steps == 37
    with pytest.raises(ConfigError, match="scheduler.type"):
        build_lr_function(OptimizerConfig(scheduler_type="OneCycle"), 10)
    with pytest.raises(ConfigError, match="unknown keys"):
        build_lr_function(OptimizerConfig(scheduler_type="WarmupLR",
                                          scheduler_params={"warmup_steps": 3}), 10)
    with pytest.raises(ConfigError, match="lr-warmup-iters"):
        build_lr_function(OptimizerConfig(lr_warmup_iters=50, lr_decay_iters=20), 100)


def test_scheduler_follows_optimizer_after_load_state_dict():
    """torch.optim's load_state_dict replaces param_groups; the schedule must keep applying."""
    import torch

    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=1.0)
    s = LRScheduler(opt, lambda step: 1.0 / (1 + step))
    state = opt.state_dict()
    opt.load_state_dict(state)
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    s.load_state_dict({"num_steps": 3})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
