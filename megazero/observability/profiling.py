"""Megatron's ``--profile``: profile a window of training iterations on chosen ranks.

Iterations ``[--profile-step-start, --profile-step-end)`` (1-based, as the log numbers them) on
the ranks in ``--profile-ranks``. With ``--use-pytorch-profiler`` the window runs under
``torch.profiler`` (CPU and CUDA activities): when it closes, the rank prints a table of the
operators and kernels that took the most device time (host time on a CPU run) and writes a
Chrome trace (to ``--tensorboard-dir`` when one is set, else beside ``--log-json``, else the
working directory). Without it, the window is a ``cudaProfilerStart``/``cudaProfilerStop`` range
for ``nsys profile --capture-range=cudaProfilerApi``, as Megatron does.

Profiling is per rank and issues no collective, so ranks that do not profile run the same
schedule.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megazero.config.sections import LoggingConfig

ROWS = 25


class StepProfiler:
    def __init__(self, cfg: LoggingConfig, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.active = cfg.profile and rank in cfg.profile_ranks
        self._prof: Any = None
        self.table: str | None = None
        self.trace: str | None = None

    def note(self) -> str | None:
        """What a profiling rank should be told before the window: a CUDA profiler range on a
        run without CUDA captures nothing (the first profiling rank says it, once)."""
        if not self.active or self.cfg.use_pytorch_profiler or self.device.type == "cuda":
            return None
        if self.rank != min(self.cfg.profile_ranks):
            return None
        return (f"--profile without --use-pytorch-profiler marks iterations "
                f"{self.cfg.profile_step_start}-{self.cfg.profile_step_end - 1} as an nsys "
                f"capture range (cudaProfilerStart/Stop), which a run on {self.device.type} "
                f"does not have: nothing is profiled; add --use-pytorch-profiler for "
                f"torch.profiler's table and trace")

    def _out_dir(self) -> str:
        if self.cfg.tensorboard_dir:
            return self.cfg.tensorboard_dir
        if self.cfg.log_json:
            return os.path.dirname(os.path.abspath(self.cfg.log_json))
        return os.getcwd()

    def before(self, iteration: int) -> None:
        """Called before the iteration numbered ``iteration`` runs."""
        if not self.active or iteration != self.cfg.profile_step_start:
            return
        if self.cfg.use_pytorch_profiler:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts, record_shapes=False)
            self._prof.__enter__()
        elif self.device.type == "cuda":
            torch.cuda.profiler.start()  # type: ignore[no-untyped-call]

    def after(self, iteration: int) -> str | None:
        """Called after the iteration numbered ``iteration`` ran; returns the table (once, on
        a profiling rank, when the window closes)."""
        if not self.active or iteration != self.cfg.profile_step_end - 1:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._prof is None:
            if self.device.type == "cuda":
                torch.cuda.profiler.stop()  # type: ignore[no-untyped-call]
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        n = self.cfg.profile_step_end - self.cfg.profile_step_start
        self.table = (f"profile of iterations {self.cfg.profile_step_start}-"
                      f"{self.cfg.profile_step_end - 1} ({n}), rank {self.rank}, by {sort}:\n"
                      + prof.key_averages().table(sort_by=sort, row_limit=ROWS))
        out = self._out_dir()
        os.makedirs(out, exist_ok=True)
        self.trace = os.path.join(out, f"profile_rank{self.rank}_iter"
                                       f"{self.cfg.profile_step_start}.json")
        prof.export_chrome_trace(self.trace)
        return self.table + f"\nChrome trace: {self.trace}"
