"""Megatron's TensorBoard switches do what they say: the queue size, the timers (written, not
printed), batch size and validation perplexity against the samples consumed, the wandb flags,
and the optimizer states (norms of the moments and weights, the same numbers at every layout)."""

from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megazero.config import LoggingConfig
from megazero.observability.monitor import Monitor
from megazero.testing.distributed import run_distributed
from megazero.testing.launch import read_metrics
from megazero.testing.training_runs import TINY


def _events(path) -> EventAccumulator:
    acc = EventAccumulator(str(path))
    acc.Reload()
    return acc


def _run_monitor(cfg: LoggingConfig) -> None:
    mon = Monitor(cfg, enabled=True)
    for it in (1, 2):
        mon.record(2.0, False, 0.1, breakdown={"forward": 0.04, "backward": 0.05})
        mon.report(it, 2, 8 * it, 1e-3, 8, 16, None, 1.0, 1e9, 1)
    mon.report_validation(2, 1.5, consumed_samples=16)
    mon.close()


def test_switches_add_megatrons_series(tmp_path, capsys):
    on = LoggingConfig(tensorboard_dir=str(tmp_path / "on"), log_batch_size_to_tensorboard=True,
                       log_validation_ppl_to_tensorboard=True, log_timers_to_tensorboard=True,
                       tensorboard_queue_size=3)
    _run_monitor(on)
    out = capsys.readouterr().out
    assert "time breakdown" not in out  # --log-timers-to-tensorboard writes, does not print
    acc = _events(tmp_path / "on")
    tags = set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("batch-size vs samples")] == [(8, 8), (16, 8)]
    ppl = acc.Scalars("lm loss validation ppl vs samples")
    assert [(e.step, e.value) for e in ppl] == [(16, pytest.approx(math.exp(1.5)))]
    assert [e.value for e in acc.Scalars("time/forward_ms")] == pytest.approx([40.0, 40.0])
    assert "time/backward_ms" in tags
    off = LoggingConfig(tensorboard_dir=str(tmp_path / "off"))
    _run_monitor(off)
    tags = set(_events(tmp_path / "off").Tags()["scalars"])
    assert not {"batch-size vs samples", "lm loss validation ppl vs samples"} & tags
    assert "batch-size" in tags and "lm loss validation ppl" in tags  # written at any setting
    printed = LoggingConfig(wall_clock_breakdown=True)
    _run_monitor(printed)
    assert "time breakdown (ms per iteration)" in capsys.readouterr().out


def test_queue_size_reaches_the_writer(tmp_path, monkeypatch):
    seen = {}
    import torch.utils.tensorboard as tb

    class Spy(tb.SummaryWriter):
        def __init__(self, *a, **kw):
            seen.update(kw)
            super().__init__(*a, **kw)

    monkeypatch.setattr(tb, "SummaryWriter", Spy)
    Monitor(LoggingConfig(tensorboard_dir=str(tmp_path), tensorboard_queue_size=5),
            enabled=True).close()
    assert seen["max_queue"] == 5


def test_wandb_flags_open_wandb(monkeypatch):
    import sys
    import types

    calls = {}
    fake = types.SimpleNamespace(init=lambda **kw: calls.update(kw), log=lambda *a, **k: None,
                                 finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    mon = Monitor(LoggingConfig(wandb_project="proj", wandb_exp_name="exp0",
                                wandb_save_dir="/tmp/wb"), enabled=True)
    mon.close()
    assert (calls["project"], calls["name"], calls["dir"]) == ("proj", "exp0", "/tmp/wb")


def _states(rank, world, args, log):
    from megazero.testing.training_runs import train_in_rank

    _, run = train_in_rank(rank, world, [*args, "--log-json", log], keep_run=True)
    if world > 1:
        return None
    # the reference: every master and moment of the one process, summed by hand
    masters, m, v = [], [], []
    for piece in run.engine.masters.pieces:
        st = run.engine.masters.optimizer.state[piece.master]
        masters.append(piece.master.double().flatten())
        m.append(st["exp_avg"].double().flatten())
        v.append(st["exp_avg_sq"].double().flatten())
    w, m, v = torch.cat(masters), torch.cat(m), torch.cat(v)
    return {"weight_l2": w.norm().item(), "momentum_l1": m.abs().sum().item(),
            "variance_sqrt_l2": v.sqrt().norm().item(), "variance_abs_max": v.abs().max().item()}


def test_optimizer_states_are_the_models_at_any_layout(tmp_path):
    args = [*TINY, "--train-iters", "3", "--log-interval", "1",
            "--log-optimizer-states-to-tensorboard", "--untie-embeddings-and-output-weights"]
    one = tmp_path / "one.jsonl"
    ref, = run_distributed(_states, 1, args, str(one))
    four = tmp_path / "four.jsonl"
    run_distributed(_states, 4, [*args, "--tensor-model-parallel-size", "2", "--zero-stage", "1"],
                    str(four))
    a, b = read_metrics(one), read_metrics(four)
    for name, value in ref.items():  # the last logged iteration holds the final states
        assert a[3][f"optimizer/{name}"] == pytest.approx(value, rel=1e-6), name
    for it in (1, 2, 3):
        for key in [k for k in a[it] if k.startswith("optimizer/")]:
            assert b[it][key] == pytest.approx(a[it][key], rel=1e-4), (it, key)
