"""MoE flags land in the config; every bad MoE input is one line naming the flag and the fix,
raised by the config (before any process group), and one line for a whole launched job."""

from __future__ import annotations

import pytest

from megazero.config import ConfigError, load_config
from megazero.testing.launch import run_training

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]


def test_moe_flags_fill_the_model_and_parallel_config():
    cfg = load_config(BASE + [
        "--num-experts", "8", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "([1]*1+[0])*2",
        "--moe-router-topk", "1", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
        "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
        "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
        "--moe-z-loss-coeff", "1e-3", "--moe-aux-loss-coeff", "1e-2",
        "--expert-model-parallel-size", "4"], world_size=8)
    m = cfg.model.moe
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_layer_freq) == (8, 48, (1, 0, 1, 0))
    assert (m.moe_router_topk, m.moe_router_score_function, m.moe_token_drop_policy) == (
        1, "sigmoid", "position")
    assert m.moe_expert_capacity_factor == 1.5 and m.moe_grouped_gemm and m.moe_shared_expert_gate
    assert [m.is_moe_layer(i, 4) for i in range(4)] == [True, False, True, False]
    layout = cfg.layout()
    assert (layout.ep, layout.etp, layout.edp) == (4, 1, 2)
    assert not load_config(BASE, world_size=1).model.moe.enabled


BAD = [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "8", "--expert-model-parallel-size", "4",
      "--pipeline-model-parallel-size", "2"], 4, "does not divide the world size 4"),
    (["--num-experts", "8", "--moe-router-load-balancing-type", "sinkhorn",
      "--moe-expert-capacity-factor", "1.0"], 1, "--moe-expert-capacity-factor 1.0 does not apply"),
    (["--num-experts", "8", "--moe-router-enable-expert-bias"], 1,
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (["--num-experts", "8", "--expert-model-parallel-size", "2",
      "--tensor-model-parallel-size", "2"], 4, "needs --sequence-parallel"),
    (["--expert-model-parallel-size", "2"], 2, "needs a Mixture-of-Experts model"),
    (["--num-experts", "8", "--moe-pad-expert-input-to-capacity"], 1,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    (["--num-experts", "8", "--moe-layer-freq", "[1,0,1]"], 1, "--moe-layer-freq lists 3"),
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "18", "--expert-tensor-parallel-size",
      "4"], 4, "--moe-ffn-hidden-size 18 is not divisible by --expert-tensor-parallel-size 4"),
    (["--num-experts", "4", "--context-parallel-size", "2", "--attention-dropout", "0",
      "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4,
     "does not divide the world size 4"),
]


def test_moe_with_context_parallelism_carves_the_expert_grid_from_the_whole_world():
    """megatron-core's expert grid counts the CP ranks: edp = world / (etp ep pp), and expert
    parallelism may span CP ranks."""
    cfg = load_config(BASE + ["--num-experts", "4", "--context-parallel-size", "2",
                              "--attention-dropout", "0", "--expert-model-parallel-size", "2"],
                      world_size=8)
    layout = cfg.layout()
    assert (layout.cp, layout.dp, layout.ep, layout.edp) == (2, 4, 2, 4)
    assert layout.all_groups("ep")[0] == layout.all_groups("cp")[0] == [0, 1]


def test_zero3_with_an_expert_data_parallel_group_apart_from_dp_is_accepted():
    # EP 2, TP 1: edp (2) is not dp (4); stage 3 partitions the experts over edp
    cfg = load_config(BASE + ["--num-experts", "4", "--expert-model-parallel-size", "2",
                              "--zero-stage", "3"], world_size=4)
    layout = cfg.layout()
    assert (cfg.zero.stage, layout.dp, layout.edp) == (3, 4, 2)


@pytest.mark.parametrize("argv,world,part", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_moe_input_is_one_config_error_line(argv, world, part):
    with pytest.raises(ConfigError) as err:
        load_config(BASE + argv, world_size=world)
    msg = str(err.value)
    assert part in msg and "\n" not in msg, msg


def test_lamb_with_split_experts_is_one_config_error_line():
    with pytest.raises(ConfigError) as err:
        load_config(BASE + ["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
                    world_size=2, ds_config={"optimizer": {"type": "Lamb",
                                                           "params": {"lr": 1e-3}}})
    msg = str(err.value)
    assert "optimizer lamb (optimizer.type) with --expert-model-parallel-size 1 x " \
        "--expert-tensor-parallel-size 2" in msg and "\n" not in msg, msg


def test_bad_moe_input_is_one_line_for_a_launched_job():
    args = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            *BASE, "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
            "--distributed-backend", "gloo", "--num-experts", "3",
            "--expert-model-parallel-size", "2"]
    proc = run_training(args, nproc=2, timeout=120, launcher=["--standalone", "--tee", "3"])
    text = proc.stdout + proc.stderr
    # lines the ranks wrote (torchrun --tee prefixes them; its own summary repeats the error)
    ranks = [x for x in text.splitlines() if x.startswith("[default")]
    errors = [x for x in ranks if "pretrain_gpt.py: error:" in x]
    assert proc.returncode != 0 and len(errors) == 1, text[-3000:]
    assert "--num-experts 3 is not divisible by --expert-model-parallel-size 2" in errors[0]
    assert not [x for x in ranks if "Traceback" in x]
