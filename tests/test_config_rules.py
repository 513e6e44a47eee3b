"""megazero.config.rules (and the model's split rules in megazero.config.model_schema): each size
rule is one function, and its callers give its message.

Every case checks the rule against the arithmetic it states (divisibility, the divisor lists the
messages suggest) and that a caller outside the config (topology, partition, schedules, model
setup) raises the same words as the command line does.
"""

import subprocess
import sys
import typing
import warnings

import pytest

from megazero.config import (
    DS_CONFIG_KEYS,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    build_parser,
    check_tensor_parallel_split,
    load_config,
    rules,
)
from megazero.config.layout import ParallelLayout
from megazero.errors import TopologyError
from megazero.pipeline.partition import chunk_layer_ranges
from megazero.pipeline.schedules import build_schedule


def _cli_error(argv, world):
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
                     *argv], world)
    return str(e.value)


def test_divisors_against_brute_force():
    for n in (1, 6, 12, 97, 360):
        assert rules.divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert rules.divisors(12) == [1, 2, 3, 4, 6, 12]


def test_world_size_rule_is_shared_by_config_and_topology():
    assert rules.check_world_size(24, 2, 3) == 4
    with pytest.raises(ConfigError) as cfg_err:
        rules.check_world_size(6, 4, 1)
    with pytest.raises(TopologyError) as topo_err:
        ParallelLayout(6, tp=4)
    assert str(cfg_err.value) == str(topo_err.value)
    assert "(3, 2)" in str(cfg_err.value) and "(4, 1)" not in str(cfg_err.value)
    assert str(cfg_err.value) in _cli_error(["--tensor-model-parallel-size", "4"], 6)
    assert ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=3,
                          world_size=24).dp == 4


def test_layers_over_pipeline_rule_is_shared_by_config_and_partition():
    assert rules.pipeline_chunks(12, 2, None) == 1
    assert rules.pipeline_chunks(12, 2, 2) == 3  # 6 layers per stage, 2 per chunk
    with pytest.raises(ConfigError) as part:
        chunk_layer_ranges(10, 4)
    assert "valid pipeline sizes for 10 layers: [1, 2, 5, 10]" in str(part.value)
    assert str(part.value) == _cli_error(["--num-layers", "10", "--pipeline-model-parallel-size",
                                          "4"], 4)
    with pytest.raises(ConfigError) as part:
        chunk_layer_ranges(8, 2, 3)
    assert "valid values: [1, 2, 4]" in str(part.value) and "= 6" in str(part.value)
    assert str(part.value) == _cli_error(["--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "3"], 2)


def test_vpp_needs_pp_is_one_rule():
    rules.check_vpp_needs_pp(2, 4)
    rules.check_vpp_needs_pp(1, 1)  # one chunk is no interleaving
    rules.check_vpp_needs_pp(1, None)
    with pytest.raises(TopologyError, match="needs pipeline parallelism"):
        ParallelLayout(4, tp=2, vpp=2)
    with pytest.raises(ConfigError, match="needs pp > 1"):
        build_schedule(1, 2, 4, 0)
    msg = _cli_error(["--num-layers-per-virtual-pipeline-stage", "2"], 1)
    assert msg.startswith("--num-layers-per-virtual-pipeline-stage") and "pp=1" in msg


def test_sequence_parallel_is_active_only_with_tp_and_needs_whole_sequences():
    assert [rules.sequence_parallel_active(sp, tp) for sp, tp in
            ((True, 1), (True, 2), (False, 2))] == [False, True, False]
    assert ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                          world_size=2).sequence_parallel_active
    assert not ParallelConfig(sequence_parallel=True).sequence_parallel_active
    rules.check_sequence_split(30, 1, True)  # no split without TP
    rules.check_sequence_split(30, 4, False)
    with pytest.raises(ConfigError, match="--seq-length 30 is not divisible by "
                                          "--tensor-model-parallel-size 4"):
        rules.check_sequence_split(30, 4, True)
    with pytest.raises(ConfigError, match="--seq-length 18"):
        check_tensor_parallel_split(ModelConfig(seq_length=18, num_attention_heads=4), 4, True)


def test_num_microbatches_and_its_message():
    assert rules.num_microbatches(32, 2, 4) == 4
    with pytest.raises(ConfigError) as e:
        rules.num_microbatches(30, 2, 4)
    assert "30 is not divisible by" in str(e.value) and "= 8" in str(e.value)
    assert "(e.g. 24 or 32)" in str(e.value)
    msg = _cli_error(["--global-batch-size", "30", "--micro-batch-size", "2"], 4)
    assert "30 is not divisible by" in msg and "e.g. 24 or 32" in msg


def test_rules_import_without_torch():
    code = ("import sys, megazero.config.rules; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == "[]"


def test_choices_come_from_the_literal_types():
    parser = build_parser()
    choices = {a.option_strings[0]: tuple(a.choices) for a in parser._actions if a.choices}
    assert choices["--normalization"] == typing.get_args(
        typing.get_type_hints(ModelConfig)["normalization"]) == ("LayerNorm", "RMSNorm")
    assert choices["--recompute-granularity"] == ("full", "selective")  # None is "not given"
    assert choices["--zero-stage"] == (0, 1, 2, 3)
    assert DS_CONFIG_KEYS["zero_optimization.offload_param.device"].choices == (
        "none", "cpu", "nvme")
    assert "invalid choice: 'BatchNorm'" in _cli_error(["--normalization", "BatchNorm"], 1)
    with pytest.raises(ConfigError, match='zero_optimization.stage: got 4, expected one of 0, '):
        load_config([], 1, ds_config={"zero_optimization": {"stage": 4}})
