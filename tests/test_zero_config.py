"""Configuration checks of the ZeRO engine (no processes)."""

import warnings

import pytest

from megazero.config import ConfigError, OffloadConfig, ZeroConfig
from megazero.config.layout import ParallelLayout
from megazero.distributed.topology import ParallelTopology
from megazero.zero.build import IMPLEMENTED_KEYS, NO_EFFECT_KEYS, check_zero_config


def _topo(pp: int = 1) -> ParallelTopology:
    return ParallelTopology(ParallelLayout(world_size=2 * pp, pp=pp), rank=0)


def test_nvme_offload_needs_a_path_and_names_the_key():
    for key in ("offload_optimizer", "offload_param"):
        zero = ZeroConfig(stage=3, **{key: OffloadConfig(device="nvme")})
        with pytest.raises(ConfigError, match=f'zero_optimization.{key}.device is "nvme" but '
                                              f"zero_optimization.{key}.nvme_path is not set"):
            check_zero_config(zero, _topo())


def test_stage3_with_pipeline_is_accepted():
    """Each pipeline stage shards its own chunks (equivalence: tests/test_zero_gpt.py)."""
    for stage in (2, 3):
        check_zero_config(ZeroConfig(stage=stage), _topo(pp=2))


def test_offload_optimizer_needs_a_sharded_stage():
    with pytest.raises(ConfigError, match="offload_optimizer needs stage 1, 2 or 3"):
        check_zero_config(ZeroConfig(stage=0, offload_optimizer=OffloadConfig("cpu")), _topo())


def test_keys_without_effect_at_this_stage_warn_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_zero_config(ZeroConfig(stage=2, offload_param=OffloadConfig("cpu"),
                                     contiguous_gradients=False), _topo())
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert any("offload_param" in m for m in messages)
    assert any("contiguous_gradients" in m for m in messages)


def test_key_tables_cover_every_zero_config_field():
    fields = set(ZeroConfig.__dataclass_fields__)
    listed = set(IMPLEMENTED_KEYS) | {k for k, _ in NO_EFFECT_KEYS}
    assert fields == listed
