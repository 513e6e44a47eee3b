"""Megatron's --profile / --use-pytorch-profiler: the window of iterations is profiled on the
chosen ranks only, and closes with a table of the top operators and a Chrome trace."""

import json

import pytest
import torch

from megazero.config import ConfigError, load_config
from megazero.config.sections import LoggingConfig
from megazero.observability.profiling import StepProfiler


def _run(profiler, iterations):
    tables = []
    a = torch.randn(64, 64)
    for it in range(1, iterations + 1):
        profiler.before(it)
        (a @ a).sum()
        t = profiler.after(it)
        if t is not None:
            tables.append((it, t))
    return tables


def test_the_window_is_profiled_once_on_the_chosen_rank(tmp_path):
    cfg = LoggingConfig(profile=True, use_pytorch_profiler=True, profile_step_start=2,
                        profile_step_end=4, profile_ranks=(0,), tensorboard_dir=str(tmp_path))
    prof = StepProfiler(cfg, 0, torch.device("cpu"))
    tables = _run(prof, 6)
    assert [it for it, _ in tables] == [3]
    assert "aten::mm" in tables[0][1] and "iterations 2-3 (2)" in tables[0][1]
    trace = json.loads(open(prof.trace, encoding="utf-8").read())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert _run(StepProfiler(cfg, 1, torch.device("cpu")), 6) == []
    assert _run(StepProfiler(LoggingConfig(), 0, torch.device("cpu")), 6) == []


def test_flags_and_an_empty_window():
    cfg = load_config(["--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
                       "--profile-step-end", "5", "--profile-ranks", "0", "2"], world_size=4)
    assert (cfg.logging.profile_step_start, cfg.logging.profile_ranks) == (3, (0, 2))
    with pytest.raises(ConfigError, match="--profile-step-start 5 and --profile-step-end 5"):
        load_config(["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
                    world_size=1)


def test_a_cuda_range_on_a_cpu_run_is_said_once():
    cfg = LoggingConfig(profile=True, profile_step_start=4, profile_step_end=6,
                        profile_ranks=(1, 3))
    cpu = torch.device("cpu")
    note = StepProfiler(cfg, 1, cpu).note()
    assert note is not None and "nothing is profiled; add --use-pytorch-profiler" in note
    assert "iterations 4-5" in note
    assert StepProfiler(cfg, 3, cpu).note() is None  # the first profiling rank says it
    assert StepProfiler(cfg, 0, cpu).note() is None  # not a profiling rank
    assert StepProfiler(cfg, 1, torch.device("cuda", 0)).note() is None  # nsys captures it
    with_torch = LoggingConfig(profile=True, use_pytorch_profiler=True, profile_ranks=(1,))
    assert StepProfiler(with_torch, 1, cpu).note() is None
