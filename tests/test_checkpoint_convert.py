"""tools/checkpoint/convert.py: one consolidated fp32 file from a ZeRO-3 tp2 checkpoint, the
weights-only megazero saver, and clean failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY, train_in_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "checkpoint", "convert.py")
MODEL = [*TINY, "--num-layers", "2", "--swiglu", "--untie-embeddings-and-output-weights"]


def _train_zero3_tp2(rank, world, tmp):
    train_in_rank(rank, world, [*MODEL, "--tensor-model-parallel-size", "2", "--zero-stage",
                                "3", "--train-iters", "2", "--save", f"{tmp}/z3"])


def _load_tp1(rank, world, tmp, ck, flags):
    from megazero.config import load_config
    from megazero.tensor_parallel.utils import full_model_state_dict
    from megazero.training.lifecycle import setup

    run = setup(load_config([*MODEL, *flags, "--train-iters", "4", "--load", ck], world))
    run.monitor.close()
    with run.engine.gathered_parameters():
        state = full_model_state_dict(run.chunks[0], run.topo)
    return {k: v.numpy() for k, v in state.items()}


def _convert(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))


def test_consolidate_zero3_tp2(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_train_zero3_tp2, 4, tmp, timeout=240)
    out = _convert("--loader", "megazero", "--saver", "torch", "--load-dir", f"{tmp}/z3",
                   "--save-dir", f"{tmp}/flat")
    assert out.returncode == 0, out.stderr
    flat = torch.load(f"{tmp}/flat/model.pt", weights_only=True)
    assert json.load(open(f"{tmp}/flat/config.json"))["model"]["swiglu"] is True
    # The same checkpoint loaded by one process at ZeRO-0: the consolidated file equals it.
    [ref] = run_distributed(_load_tp1, 1, tmp, f"{tmp}/z3", [], timeout=120)
    assert sorted(flat) == sorted(ref)
    for k, v in ref.items():
        assert flat[k].dtype == torch.float32 and torch.equal(flat[k], torch.from_numpy(v)), k
    assert flat["embedding.word_embeddings.weight"].shape[0] == 100  # padding stripped

    # megazero saver: weights only; --finetune loads it at tp2 (2 ranks) with these weights.
    out = _convert("--loader", "megazero", "--saver", "megazero", "--load-dir", f"{tmp}/z3",
                   "--save-dir", f"{tmp}/w")
    assert out.returncode == 0, out.stderr
    got = run_distributed(_load_tp1, 2, tmp, f"{tmp}/w",
                          ["--tensor-model-parallel-size", "2", "--finetune"], timeout=120)
    for k, v in ref.items():
        assert torch.equal(torch.from_numpy(got[0][k]), torch.from_numpy(v)), k

    # bf16 output; then a damaged shard: one line, nothing written.
    out = _convert("--loader", "megazero", "--saver", "torch", "--load-dir", f"{tmp}/z3",
                   "--save-dir", f"{tmp}/bf", "--dtype", "bf16")
    assert out.returncode == 0
    assert torch.load(f"{tmp}/bf/model.pt")["output_layer.weight"].dtype == torch.bfloat16
    shard = os.path.join(tmp, "z3", "iter_0000002", "mp_rank_01_000_000", "model_000.pt")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-7])
    out = _convert("--loader", "megazero", "--saver", "torch", "--load-dir", f"{tmp}/z3",
                   "--save-dir", f"{tmp}/bad")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "mp_rank_01_000_000/model_000.pt" in out.stderr and "truncated" in out.stderr
    assert not os.path.exists(f"{tmp}/bad")
    assert not [n for n in os.listdir(tmp) if n.startswith(".convert-")]
