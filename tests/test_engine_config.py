"""The engine's config resolution (no processes): sources, "auto" batch triad, DeepSpeed's
defaults for keys the JSON leaves out."""

from __future__ import annotations

import argparse
import os

import pytest

from megazero.config import ConfigError
from megazero.engine.config import load_engine_config

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "ds_config_zero2.json")


def test_auto_triad_resolved_against_world_size():
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": "auto", "optimizer": {"type": "AdamW"}}
    t = load_engine_config(None, ds, None, world_size=4).train
    assert (t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (16, 2, 2)
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3,
          "gradient_accumulation_steps": 5}
    assert load_engine_config(None, ds, None, world_size=2).train.global_batch_size == 30
    with pytest.raises(ConfigError, match=r"batch-size\) 16 is not divisible by"):
        load_engine_config(None, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3},
                           None, world_size=2)


def test_file_from_args_with_comments_and_deepspeed_defaults():
    cfg = load_engine_config(argparse.Namespace(deepspeed_config=EXAMPLE), None, None, 2)
    assert cfg.zero.stage == 2 and cfg.train.global_batch_size == 4 * 2 * 2
    assert cfg.optimizer.clip_grad == 1.0 and cfg.optimizer.weight_decay == 0.01
    assert cfg.optimizer.scheduler_type == "WarmupLR"
    # absent keys mean what they mean in DeepSpeed: no clipping, no weight decay, lr 1e-3
    bare = load_engine_config(None, None, {"optimizer": {"type": "Adam"}}, 1).optimizer
    assert (bare.clip_grad, bare.weight_decay, bare.lr) == (0.0, 0.0, 1e-3)


def test_config_sources_are_exclusive_and_required():
    with pytest.raises(ConfigError, match="given twice"):
        load_engine_config(argparse.Namespace(deepspeed_config=EXAMPLE), {}, None, 1)
    with pytest.raises(ConfigError, match="needs a DeepSpeed config"):
        load_engine_config(argparse.Namespace(), None, None, 1)
    with pytest.raises(ConfigError, match="scheduler.type 'LRRangeTest' is not supported"):
        load_engine_config(None, {"scheduler": {"type": "LRRangeTest"}}, None, 1)
