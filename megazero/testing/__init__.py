"""Helpers for testing multi-rank code on CPU with gloo."""

from megazero.testing.distributed import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
