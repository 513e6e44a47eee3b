"""Resuming never silently changes the run: a --load that does not exist is refused (unless it is
--save, a requeued job's first launch), a different learning-rate schedule is refused unless
--override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler says which one wins, and
"auto" JSON scheduler values take the flags."""

from __future__ import annotations

import json

import pytest

from megazero.checkpoint import config_dict
from megazero.config import ConfigError, load_config
from megazero.training.resume_checks import TRACKER, check_resume

BASE = ["--mock-data", "--train-iters", "100", "--lr", "1e-3", "--min-lr", "1e-5",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "10"]


def _fake_checkpoint(root, argv, iteration=20):
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config_dict(load_config(argv, 1))))
    (root / TRACKER).write_text(str(iteration))
    return str(root)


def test_missing_load_dir_is_refused_unless_it_is_save(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="--load .*nope: no such directory"):
        check_resume(load_config([*BASE, "--load", missing], 1))
    cfg = load_config([*BASE, "--load", missing, "--save", missing], 1)
    assert check_resume(cfg) == cfg


@pytest.mark.parametrize("extra, named", [
    (["--train-iters", "200"], "--lr-decay-iters 200 (checkpoint: 100)"),
    (["--lr", "2e-3"], "--lr 0.002 (checkpoint: 0.001)"),
    (["--min-lr", "0"], "--min-lr 0.0 (checkpoint: 1e-05)"),
    (["--lr-decay-style", "linear"], "--lr-decay-style linear (checkpoint: cosine)"),
])
def test_a_different_schedule_is_refused_or_chosen(tmp_path, extra, named):
    root = _fake_checkpoint(tmp_path / "ck", BASE)
    argv = [*BASE, "--load", root, *extra]
    with pytest.raises(ConfigError) as e:
        check_resume(load_config(argv, 1))
    assert named in str(e.value) and "--override-opt_param-scheduler" in str(e.value)
    new = load_config([*argv, "--override-opt_param-scheduler"], 1)
    assert check_resume(new) == new
    kept = check_resume(load_config([*argv, "--use-checkpoint-opt_param-scheduler"], 1))
    old = load_config(BASE, 1).optimizer
    assert (kept.optimizer.lr, kept.optimizer.min_lr, kept.optimizer.lr_decay_style) == (
        old.lr, old.min_lr, old.lr_decay_style)
    assert kept.optimizer.lr_decay_iters == 100


def test_same_schedule_and_longer_run_with_fixed_decay_resume(tmp_path):
    root = _fake_checkpoint(tmp_path / "ck", [*BASE, "--lr-decay-iters", "100"])
    cfg = load_config([*BASE, "--lr-decay-iters", "100", "--train-iters", "300", "--load",
                       root], 1)
    assert check_resume(cfg) == cfg
    cfg = load_config([*BASE, "--train-iters", "300", "--load", root, "--finetune"], 1)
    assert check_resume(cfg) == cfg


def test_min_lr_fills_auto_warmup_min_lr():
    ds = {"scheduler": {"type": "WarmupDecayLR",
                        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                   "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    cfg = load_config([*BASE[:-6], "--min-lr", "1e-5"], 1, ds_config=ds)
    assert cfg.optimizer.scheduler_params["warmup_min_lr"] == 1e-5
    assert cfg.optimizer.scheduler_params["warmup_min_lr"] == 1e-5


def test_use_checkpoint_args_takes_the_saved_model(tmp_path):
    saved = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "6",
             "--position-embedding-type", "rope", "--swiglu"]
    root = _fake_checkpoint(tmp_path / "ck", [*BASE, *saved])
    cfg = check_resume(load_config([*BASE, "--load", root, "--use-checkpoint-args"], 1))
    want = load_config([*BASE, *saved], 1).model
    assert cfg.model == want
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load"):
        check_resume(load_config([*BASE, "--use-checkpoint-args"], 1))
    with pytest.raises(ConfigError, match="not divisible"):  # the layout is checked again
        check_resume(load_config([*BASE, "--load", root, "--use-checkpoint-args",
                                  "--tensor-model-parallel-size", "4"], 4))


def test_use_checkpoint_args_brings_the_experts_that_expert_parallelism_splits(tmp_path):
    saved = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--num-experts", "4", "--moe-ffn-hidden-size", "24"]
    root = _fake_checkpoint(tmp_path / "ck", [*BASE, *saved])
    cfg = check_resume(load_config([*BASE, "--load", root, "--use-checkpoint-args",
                                    "--expert-model-parallel-size", "2"], 2))
    assert (cfg.model.moe.num_experts, cfg.layout().ep) == (4, 2)
    with pytest.raises(ConfigError, match="--num-experts 4 is not divisible by "
                       "--expert-model-parallel-size 8"):  # checked again with the experts
        check_resume(load_config([*BASE, "--load", root, "--use-checkpoint-args",
                                  "--expert-model-parallel-size", "8"], 8))
    dense = _fake_checkpoint(tmp_path / "dense", BASE)
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts model"):
        check_resume(load_config([*BASE, "--load", dense, "--use-checkpoint-args",
                                  "--expert-model-parallel-size", "2"], 2))
