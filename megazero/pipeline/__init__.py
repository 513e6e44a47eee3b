"""Pipeline parallelism: layer partitioning, schedules as data, their checker, p2p, executor."""

from megazero.pipeline.checker import ScheduleError, SimResult, check_schedules, render_grid
from megazero.pipeline.schedules import Action, build_all, build_schedule

__all__ = ["Action", "ScheduleError", "SimResult", "build_all", "build_schedule",
           "check_schedules", "render_grid"]
