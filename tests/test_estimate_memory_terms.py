"""tools/estimate_memory.py prints the 1-bit optimizers' state and the MoE dispatch term on
lines of their own, and takes pretrain_gpt.py's flags after a literal ``--``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "estimate_memory.py"
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--vocab-size 128 --micro-batch-size 1 --cluster cpu --world-size 4").split()


def _main():
    spec = importlib.util.spec_from_file_location("estimate_memory_tool", TOOL)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_double_dash_separates_the_run_flags(capsys):
    main = _main()
    assert main([*MODEL, "--json", "--", "--zero-stage", "1",
                 "--tensor-model-parallel-size", "2"]) == 0
    with_dashes = json.loads(capsys.readouterr().out)
    assert main([*MODEL, "--json", "--zero-stage", "1",
                 "--tensor-model-parallel-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == with_dashes


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_onebit_state_lines(kind, tmp_path, capsys):
    from megazero.planner.onebit_states import SCALARS, SERVER, WORKER

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                              "optimizer": {"type": kind, "params": {"lr": 1e-3}},
                              "zero_optimization": {"stage": 0}}))
    assert _main()([*MODEL, "--deepspeed_config", str(ds)]) == 0
    out = capsys.readouterr().out
    assert WORKER in out and SERVER in out
    assert (SCALARS in out) == (kind != "OneBitAdam")


def test_moe_dispatch_term(capsys):
    assert _main()([*MODEL, "--num-experts", "4", "--disable-bias-linear",
                    "--expert-model-parallel-size", "2",
                    "--moe-token-dispatcher-type", "alltoall"]) == 0
    assert "MoE dispatch" in capsys.readouterr().out
