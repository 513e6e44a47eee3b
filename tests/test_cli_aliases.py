"""Flags pasted from Megatron-LM / Megatron-DeepSpeed scripts: equivalents are accepted,
renamed ones name their replacement, and "did you mean" only suggests a flag of the same
meaning (a spelling neighbour with another meaning is worse than no suggestion)."""

from __future__ import annotations

import pytest

from megazero.config import ConfigError, load_config, parse_args


@pytest.mark.parametrize("flag, not_suggested", [
    ("--skip-trains", "--clip-grad"),
    ("--cpu-offloads", "--load"),
    ("--use-rotary-position-embedding-x", "--max-position-embeddings"),
    ("--recompute-activation-x", "--recompute-method"),
])
def test_no_suggestion_of_another_meaning(flag, not_suggested):
    with pytest.raises(ConfigError) as e:
        parse_args([flag])
    assert not_suggested not in str(e.value), str(e.value)


@pytest.mark.parametrize("flag, suggested", [
    ("--hiden-size", "--hidden-size"),
    ("--tensor-model-paralel-size", "--tensor-model-parallel-size"),
    ("--use-rotary-position-embedding", "--use-rotary-position-embeddings"),
    ("--lr-decay-iter", "--lr-decay-iters"),
])
def test_typos_are_suggested(flag, suggested):
    with pytest.raises(ConfigError, match=f"did you mean {suggested}\\?"):
        parse_args([flag])


@pytest.mark.parametrize("flag, pointer", [
    ("--cpu-offload", "offload_optimizer"),
    ("--no-load-lr-state", "--override-opt_param-scheduler"),
    ("--batch-size", "--micro-batch-size"),
    ("--model-parallel-size", "--tensor-model-parallel-size"),
])
def test_renamed_flags_name_their_equivalent(flag, pointer):
    with pytest.raises(ConfigError) as e:
        parse_args([flag, "x"])
    assert pointer in str(e.value) and "not a megazero flag" in str(e.value)


def test_equivalent_flags_are_rewritten():
    cfg = load_config(["--use-rotary-position-embeddings", "--recompute-activations",
                       "--no-masked-softmax-fusion", "--use-mcore-models", "--num-workers", "2",
                       "--exit-signal-handler", "--attention-softmax-in-fp32"], 1)
    assert cfg.model.position_embedding_type == "rope"
    assert cfg.parallel.recompute_granularity == "selective"
