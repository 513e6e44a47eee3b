"""The flags of today's Megatron-LM and Megatron-DeepSpeed launch scripts read as those tools
read them, and a command line's problems (unknown flags, bad values, conflicts with the JSON)
are named together in one message."""

from __future__ import annotations

import json
import warnings

import pytest

from megazero.config import ConfigError, load_config

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--train-iters", "4", "--global-batch-size", "4"]


def _load(argv, world=1, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config([*BASE, *argv], world, **kw)


def _error(argv, world=1) -> str:
    with pytest.raises(ConfigError) as e:
        _load(argv, world)
    return str(e.value)


@pytest.mark.parametrize("spelling, name", [("rmsnorm", "RMSNorm"), ("layernorm", "LayerNorm"),
                                            ("RMSNorm", "RMSNorm"), ("LAYERNORM", "LayerNorm")])
def test_normalization_in_any_case(spelling, name):
    assert _load(["--normalization", spelling]).model.normalization == name


def test_megatron_deepspeed_spellings():
    cfg = _load(["--num-key-value-heads", "2", "--data-impl", "mmap", "--no-query-key-layer-"
                 "scaling", "--no-async-tensor-model-parallel-allreduce", "--use-flash-attn",
                 "--no-gradient-accumulation-fusion", "--deepspeed-activation-checkpointing",
                 "--checkpoint-activations", "--local_rank=0"])
    assert (cfg.model.group_query_attention, cfg.model.num_query_groups) == (True, 2)
    p = cfg.parallel
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        "full", "uniform", None)
    # the script's own recompute flags win over the old switch's meaning
    p = _load(["--checkpoint-activations", "--recompute-granularity", "full",
               "--recompute-method", "block", "--recompute-num-layers", "1"]).parallel
    assert (p.recompute_granularity, p.recompute_method) == ("full", "block")
    assert "--data-impl lazy: megazero takes mmap or infer" in _error(["--data-impl", "lazy"])


def test_megatron_values():
    cfg = _load(["--split", "'99,1,0'", "--grad-reduce-in-bf16", "--bf16",
                 "--empty-unused-memory-level", "1", "--no-mmap-bin-files",
                 "--attention-backend", "fused", "--log-throughput",
                 "--no-create-attention-mask-in-dataloader"])
    assert cfg.data.split == "99,1,0" and not cfg.data.mmap_bin_files
    assert cfg.precision.grad_dtype_name == "bf16" and cfg.train.empty_unused_memory_level == 1
    assert _load(["--split", "949, 50, 1"]).data.split == "949,50,1"
    assert "--attention-backend slow" in _error(["--attention-backend", "slow"])


def test_transformer_engine_is_a_note_not_an_error():
    with pytest.warns(UserWarning, match="--transformer-impl transformer_engine: megazero runs "
                                         "its own layers"):
        cfg = load_config([*BASE, "--transformer-impl", "transformer_engine"], 1)
    assert cfg.model.transformer_impl == "transformer_engine"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config([*BASE, "--transformer-impl", "local"], 1)


def test_fp8_flags_read_as_megatron_reads_them():
    pr = _load(["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                "--fp8-amax-compute-algo", "max", "--fp8-margin", "1", "--bf16",
                "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "0"]).precision
    assert (pr.fp8_format, pr.fp8_recipe, pr.fp8_amax_history_len, pr.fp8_amax_compute_algo,
            pr.fp8_margin, pr.first_last_layers_bf16, pr.num_layers_at_start_in_bf16,
            pr.num_layers_at_end_in_bf16) == ("hybrid", "delayed", 1024, "max", 1, True, 1, 0)
    pr = _load(["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
                "--zero-stage", "3"]).precision
    assert (pr.fp8_format, pr.fp8_recipe, pr.fp8_param_gather) == ("e4m3", "tensorwise", True)
    # Megatron's Llama-3 FP8 recipe: the distributed optimizer and delayed scaling
    cfg = _load(["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
                 "--bf16"])
    assert (cfg.zero.stage, cfg.precision.fp8_recipe, cfg.precision.fp8_param_gather) == (
        1, "delayed", True)


@pytest.mark.parametrize("argv, part", [
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe without --fp8-format: FP8 is off; add "
     "--fp8-format hybrid (or e4m3), or drop them"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-margin", "1"],
     "--fp8-margin set delayed scaling, and --fp8-recipe is blockwise"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"],
     "--num-layers-at-start-in-bf16 1 + --num-layers-at-end-in-bf16 2 exceed --num-layers 2"),
    (["--fp8-format", "hybrid", "--fp8-param-gather"], "--fp8-param-gather with --zero-stage 0"),
    (["--fp8-format", "hybrid", "--fp8-param-gather", "--zero-stage", "3"],
     "--fp8-param-gather with --fp8-recipe delayed at --zero-stage 3: ZeRO-3 gathers take one "
     "current scale per weight; use --fp8-recipe tensorwise, --use-distributed-optimizer"),
    (["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer"],
     "--fp8-param-gather with --zero-stage 1 and fp32 parameters: the gathered FP8 weights "
     "replace the 16-bit compute copy of the fp32 masters, and fp32 training has no such copy; "
     "add --bf16"),
    (["--fp8-format", "hybrid", "--fp8-margin", "-1"], "--fp8-margin -1: expected an integer"),
])
def test_bad_fp8_settings_are_one_line_naming_the_flag(argv, part):
    msg = _error(argv)
    assert part in msg and "\n" not in msg, msg


def test_every_problem_in_one_message(tmp_path):
    """Unknown flags, invalid choices, bad numbers, an FP4 flag and conflicts with the JSON: one
    launch names them all (a fixed one would otherwise reveal the next)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
                              "gradient_clipping": 1.0, "fp16": {"enabled": True}}))
    msg = _error(["--deepspeed_config", str(ds), "--micro-batch-size", "4", "--clip-grad", "0.5",
                  "--lr-decay-style", "step", "--hidden-size", "big", "--fp4-format", "e2m1",
                  "--seq-lenght", "8", "--log-timers-to-tensorboard", "--fp16"])
    assert msg.startswith("6 problems, all listed here: (1) "), msg
    for part in ("argument --lr-decay-style: invalid choice: 'step'",
                 "argument --hidden-size: invalid int value: 'big'",
                 "FP4 training is not in megazero yet, so --fp4-format e2m1",
                 "unknown argument '--seq-lenght'; did you mean --seq-length?",
                 "--micro-batch-size 4 on the command line conflicts with "
                 "train_micro_batch_size_per_gpu: 2",
                 "--clip-grad 0.5 on the command line conflicts with gradient_clipping: 1.0"):
        assert part in msg, (part, msg)
    # Megatron's --log-timers-to-tensorboard is its own setting: the JSON's
    # "wall_clock_breakdown": false is no conflict with it
    assert "wall_clock_breakdown" not in msg


def test_log_timers_to_tensorboard_is_not_the_printed_breakdown(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"wall_clock_breakdown": false}')
    lg = _load(["--log-timers-to-tensorboard", "--deepspeed_config", str(ds)]).logging
    assert (lg.log_timers_to_tensorboard, lg.wall_clock_breakdown, lg.timed) == (True, False, True)
    assert not _load([]).logging.timed


def test_wandb_flags_fill_the_wandb_block():
    lg = _load(["--wandb-project", "p", "--wandb-exp-name", "run1", "--wandb-save-dir", "w"]
               ).logging
    assert lg.wandb_block == {"enabled": True, "project": "p", "job_name": "run1",
                              "output_path": "w"}
    assert _load([]).logging.wandb_block == {}


def test_schedule_and_decoupled_lengths_are_checked():
    assert "--lr-warmup-iters and --lr-warmup-tokens all set the warm-up length" in _error(
        ["--lr-warmup-iters", "2", "--lr-warmup-tokens", "64"])
    assert "--lr-decay-iters and --lr-decay-tokens all set the decay length" in _error(
        ["--lr-decay-iters", "2", "--lr-decay-tokens", "64"])
    assert "--decoupled-min-lr 1e-05 needs --decoupled-lr" in _error(
        ["--decoupled-min-lr", "1e-5"])
    assert "drop --data-path" in _error(["--data-path", "a", "--train-data-path", "b"])


def test_empty_unused_memory_level(monkeypatch):
    import torch

    from megazero.training.loop import empty_unused_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for level, needs, device in ((0, 1, gpu), (1, 1, gpu), (1, 2, gpu), (2, 2, gpu),
                                 (2, 1, cpu)):
        empty_unused_memory(level, needs, device)
    assert len(calls) == 2  # level 1 after iterations, level 2 after evaluations too


def test_hints_offer_what_fits():
    # a global batch below one step: one example, not "e.g. 8 or 8"
    msg = _error(["--global-batch-size", "4", "--micro-batch-size", "4"], world=2)
    assert "use a multiple of 8 (e.g. 8)" in msg, msg
    # the TP sizes offered divide the heads and fit the launched world (6 heads, 4 ranks)
    msg = _error(["--num-attention-heads", "6", "--hidden-size", "48",
                  "--tensor-model-parallel-size", "4"], world=4)
    assert "use a TP size that divides the heads ([1, 2])" in msg, msg
    msg = _error(["--num-attention-heads", "6", "--hidden-size", "48",
                  "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"],
                 world=8)
    assert "([1, 2])" in msg, msg
