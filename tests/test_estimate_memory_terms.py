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


MIXTRAL = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 "
           "--ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 4096 "
           "--vocab-size 32000 --tokenizer-type NullTokenizer --bf16 --swiglu "
           "--micro-batch-size 1 --global-batch-size 256 --zero-stage 1 --num-experts 8 "
           "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
           "--expert-model-parallel-size 8 --world-size 64 --cluster h100-80gb-nvlink").split()


@pytest.mark.parametrize("flag", [[], ["--overlap-moe-expert-parallel-comm"]])
def test_exposed_ep_line_prices_the_combined_1f1b(flag, capsys):
    from megazero.planner.moe_cost import overlapped_traffic

    assert _main()([*MIXTRAL, "--json", *flag]) == 0
    out = json.loads(capsys.readouterr().out)
    assert _main()([*MIXTRAL, *flag]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    t = out["time_terms_s"]
    plain_step = out["step_time_s"]
    mb = 256 // 64  # dp 64: F0, (F1 B0), (F2 B1), (F3 B2), B3: 3 of 4 paired
    experts = (t["MoE grouped GEMM"] + t["MoE permute"]) / mb
    per_mb = {"dispatch": t["MoE dispatch"] / mb, "combine": t["MoE combine"] / mb}
    plain = mb * sum(per_mb.values())
    if flag:  # the run's own terms are the combined mode's, so those are its overlapped ones
        run = plain
        assert line.endswith(f"; with --overlap-moe-expert-parallel-comm (this run) "
                             f"{run:.3f} s ({run / plain_step:.1%} of the step), "
                             "75.0% of the forwards paired with a backward")
        return
    over = mb * sum(overlapped_traffic(per_mb, t["compute"] / mb, experts, 0.75).values())
    step = plain_step - plain + over
    assert over < plain
    assert line == (f"exposed EP communication: {plain:.3f} s ({plain / plain_step:.1%} of the "
                    f"step); with --overlap-moe-expert-parallel-comm {over:.3f} s "
                    f"({over / step:.1%} of the step), 75.0% of the forwards paired with a "
                    "backward")
