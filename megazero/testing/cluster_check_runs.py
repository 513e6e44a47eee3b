"""Rank function for tests/test_check_cluster.py: ``tools/check_cluster.py``'s ``main`` on a
spawned gloo world, as torchrun would start it, optionally with a planted failure."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os

from megazero.testing.launch import REPO


def _tool():
    spec = importlib.util.spec_from_file_location(
        "check_cluster", os.path.join(REPO, "tools", "check_cluster.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_cluster_world(rank: int, world: int, argv: list[str],
                        plant_lr_at_stage: int | None = None) -> tuple[int, str]:
    """``(exit status, what rank 0 printed)``. ``plant_lr_at_stage``: that ZeRO stage's rows
    train with another learning rate, as a layout that trains a different model would."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    if plant_lr_at_stage is not None:
        from megazero.cluster_check import training_rows

        honest = training_rows.layout_args

        def planted(stage: int, *a, **k) -> list[str]:
            args = honest(stage, *a, **k)
            return [*args, "--lr", "4e-3"] if stage == plant_lr_at_stage else args

        training_rows.layout_args = planted
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _tool().main(argv)
    return code, out.getvalue()
