"""Checkpoints this megazero cannot read whole are refused before anything is loaded, in one line
that names the file and what to do: another format version (older or newer), another format,
Megatron-LM ``mp_rank_00`` directories (numbered and ``release``), DeepSpeed's ``latest`` tag."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.checkpoint import load_checkpoint
from megazero.checkpoint.reader import MIN_VERSION, VERSION
from megazero.distributed.topology import ParallelTopology
from megazero.errors import CheckpointError
from megazero.testing.checkpoint_state import build_state, save_single
from megazero.testing.training_runs import TINY


def _load_untouched(root):
    """Load into a fresh model; return the error and whether the weights stayed as built."""
    topo = ParallelTopology.single()
    models, opt, sched, tracker = build_state(topo, seed=3)
    before = [p.detach().clone() for p in models[0].parameters()]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                        rng_tracker=tracker)
    same = all(torch.equal(a, p) for a, p in zip(before, models[0].parameters()))
    assert "\n" not in str(e.value)
    return str(e.value), same


def _edit_meta(directory, **changes):
    path = os.path.join(directory, "metadata.json")
    meta = json.load(open(path))
    meta.update(changes)
    json.dump(meta, open(path, "w"))
    return path


@pytest.mark.parametrize("version,words", [(VERSION + 1, "newer than the version"),
                                           (MIN_VERSION - 1, "older than the versions"),
                                           ("2", "not an integer")])
def test_other_format_version_is_refused(tmp_path, version, words):
    root = str(tmp_path / "ck")
    marker = _edit_meta(save_single(root), version=version)
    msg, untouched = _load_untouched(root)
    assert marker in msg and words in msg and untouched


def test_other_format_is_refused(tmp_path):
    root = str(tmp_path / "ck")
    marker = _edit_meta(save_single(root), format="torch-dcp")
    msg, untouched = _load_untouched(root)
    assert marker in msg and "'torch-dcp'" in msg and "convert.py" in msg and untouched


def _megatron(root, tracker, sub):
    """A Megatron-LM checkpoint directory: the tracker and mp_rank_00/model_optim_rng.pt."""
    os.makedirs(os.path.join(root, sub, "mp_rank_00"))
    path = os.path.join(root, sub, "mp_rank_00", "model_optim_rng.pt")
    torch.save({"iteration": 10, "model": {}}, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(tracker)
    return path


@pytest.mark.parametrize("tracker,sub", [("10", "iter_0000010"), ("release", "release")])
def test_megatron_checkpoint_is_refused(tmp_path, tracker, sub):
    root = str(tmp_path / "mg")
    path = _megatron(root, tracker, sub)
    msg, untouched = _load_untouched(root)
    assert path in msg and "Megatron" in msg and "convert.py --loader hf" in msg and untouched


def test_deepspeed_tag_is_refused_not_ignored(tmp_path):
    root = tmp_path / "ds"
    (root / "global_step10").mkdir(parents=True)
    torch.save({}, root / "global_step10" / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step10")
    msg, untouched = _load_untouched(str(root))  # not "no checkpoint: start from scratch"
    assert str(root / "latest") in msg and "DeepSpeed" in msg and untouched


def test_refused_before_the_run_starts(tmp_path):
    """pretrain_gpt.py checks the format with the other resume checks, before the process
    group, the data and the model exist."""
    from megazero.config import load_config
    from megazero.training.resume_checks import check_resume

    root = str(tmp_path / "mg")
    path = _megatron(root, "10", "iter_0000010")
    with pytest.raises(CheckpointError, match="Megatron") as e:
        check_resume(load_config([*TINY, "--train-iters", "2", "--load", root], 1))
    assert path in str(e.value)
