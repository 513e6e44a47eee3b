"""The command-line surface and the DeepSpeed key table do not drift; flags are validated.

Adding, renaming or removing a flag must be a deliberate edit of GOLDEN_FLAGS; every flag and every
JSON key must land in a MegazeroConfig field that exists. The cross-field checks of the flags
(divisibility by TP/PP, interleaving, recompute) are tested here too, each message with its fix.
"""

import dataclasses
import warnings

import pytest

from megazero.config import (
    FLAGS,
    ConfigError,
    MegazeroConfig,
    build_parser,
    field_default,
    flag_values,
    load_config,
    parse_args,
)
from megazero.config.deepspeed import DS_CONFIG_KEYS, SCHEDULER_TYPES

GOLDEN_FLAGS = """
--tensor-model-parallel-size --pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage
--microbatch-group-size-per-virtual-pipeline-stage --pipeline-schedule --delay-wgrad-compute
--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers
--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
--pipeline-model-parallel-layout
--context-parallel-size --cp-comm-type
--sequence-parallel --recompute-granularity --recompute-method --recompute-num-layers
--tp-comm-overlap --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs
--tp-comm-overlap-rs-dgrad --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad
--distribute-saved-activations
--distributed-backend --distributed-timeout-minutes --model-preset --num-layers --hidden-size
--num-attention-heads
--group-query-attention --num-query-groups --ffn-hidden-size --seq-length --max-position-embeddings
--position-embedding-type --rotary-base --normalization --norm-epsilon --swiglu
--openai-gelu
--disable-bias-linear --add-qkv-bias --qk-layernorm --untie-embeddings-and-output-weights
--attention-dropout
--hidden-dropout
--init-method-std --make-vocab-size-divisible-by --vocab-size --use-flash-attn --no-flash-attn
--bias-gelu-fusion --no-bias-gelu-fusion --bias-swiglu-fusion --no-bias-swiglu-fusion
--bias-dropout-fusion --no-bias-dropout-fusion --apply-rope-fusion --no-rope-fusion
--fusions-on-cpu
--micro-batch-size --global-batch-size --train-iters --train-samples --seed --deterministic-mode
--eval-interval
--eval-iters --exit-interval --exit-duration-in-mins --check-for-nan-in-loss-and-grad
--no-check-for-nan-in-loss-and-grad --max-nonfinite-steps --spike-factor --spike-window --lr
--min-lr --lr-decay-style
--lr-warmup-iters --lr-decay-iters --optimizer --sgd-momentum --weight-decay --adam-beta1
--adam-beta2 --adam-eps --clip-grad
--fp16 --bf16 --loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis
--accumulate-allreduce-grads-in-fp32
--fp8-format --fp8-recipe --fp8-amax-history-len --fp8-amax-compute-algo --fp8-margin
--first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16
--fp8-param-gather --log-fp8-amax
--zero-stage --deepspeed_config --deepspeed-config --deepspeed --data-path --split --mock-data
--overlap-grad-reduce --no-overlap-grad-reduce --overlap-param-gather --no-overlap-param-gather
--ddp-bucket-size
--tokenizer-type --tokenizer-model --vocab-file --merge-file --data-cache-path --save --load
--save-interval --no-load-optim --no-load-rng --finetune --eval-interval --log-interval
--override-opt_param-scheduler --overwrite-checkpoints --use-checkpoint-opt_param-scheduler
--lr-warmup-fraction
--lr-warmup-samples --lr-decay-samples --kv-channels --use-checkpoint-args
--tensorboard-dir --log-json --log-memory-phases --wall-clock-breakdown
--rotary-percent --rampup-batch-size --manual-gc --manual-gc-interval --no-manual-gc-eval
--eod-mask-loss --log-num-zeros-in-grad
--profile --use-pytorch-profiler --profile-step-start --profile-step-end --profile-ranks
--expert-model-parallel-size --expert-tensor-parallel-size --num-experts --moe-ffn-hidden-size
--moe-layer-freq --moe-router-topk --moe-router-score-function --moe-router-pre-softmax
--moe-router-topk-scaling-factor --moe-router-load-balancing-type --moe-aux-loss-coeff
--moe-z-loss-coeff --moe-router-enable-expert-bias --moe-router-bias-update-rate
--moe-expert-capacity-factor --moe-token-drop-policy --moe-pad-expert-input-to-capacity
--moe-grouped-gemm --moe-shared-expert-intermediate-size --moe-shared-expert-gate
--moe-shared-expert-overlap --overlap-moe-expert-parallel-comm
--moe-token-dispatcher-type --moe-per-layer-logging --moe-router-num-groups
--moe-router-group-topk --moe-router-dtype --multi-latent-attention --q-lora-rank --kv-lora-rank
--qk-head-dim --qk-pos-emb-head-dim --v-head-dim --rotary-scaling-factor --mscale --mscale-all-dim
--original-max-position-embeddings --mtp-num-layers --mtp-loss-scaling-factor
--reset-position-ids --reset-attention-mask
--async-save --exit-on-save-failure --max-spike-steps --log-straggler --straggler-minmax-count
--straggler-factor --straggler-patience
--train-tokens --lr-warmup-tokens --lr-decay-tokens --tensorboard-queue-size
--log-timers-to-tensorboard --log-batch-size-to-tensorboard --log-optimizer-states-to-tensorboard
--log-validation-ppl-to-tensorboard --wandb-project --wandb-exp-name --wandb-save-dir
--train-data-path --valid-data-path --test-data-path --no-mmap-bin-files --tiktoken-pattern
--tiktoken-num-special-tokens --apply-layernorm-1p --transformer-impl --decoupled-lr
--decoupled-min-lr --calculate-per-token-loss --grad-reduce-in-bf16 --empty-unused-memory-level
""".split()

CHOICES = {
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--position-embedding-type": ("learned_absolute", "rope"),
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--lr-decay-style": ("constant", "linear", "cosine"),
    "--model-preset": ("gpt2", "llama"),
    "--zero-stage": (0, 1, 2, 3),
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "blockwise", "mxfp8"),
    "--fp8-amax-compute-algo": ("most_recent", "max"),
}


def _option_strings(parser):
    return [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]


def test_flags_match_the_golden_list():
    parser = build_parser()
    assert sorted(_option_strings(parser)) == sorted(set(GOLDEN_FLAGS))
    help_text = parser.format_help()
    for flag in set(GOLDEN_FLAGS):
        assert flag in help_text


def test_choices_are_megatrons():
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    for flag, choices in CHOICES.items():
        assert tuple(actions[flag].choices) == choices
    assert actions["--data-path"].nargs == "+"


def _field_exists(path: str) -> bool:
    cls = MegazeroConfig
    for part in path.split("."):
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            return False
        cls = type(field_default(path.split(part)[0] + part))
    return True


def test_every_flag_maps_to_an_existing_field():
    assert len({n for f in FLAGS for n in f.names}) == sum(len(f.names) for f in FLAGS)
    for flag in FLAGS:
        assert _field_exists(flag.field), (flag.names, flag.field)
    # two spellings may share a field only when they are one switch's on/off or an alias
    fields = [f.field for f in FLAGS]
    shared = {f for f in fields if fields.count(f) > 1}
    assert shared == {"model.use_flash_attn", "train.check_for_nan_in_loss_and_grad",
                      "zero.overlap_comm", "zero.overlap_param_gather",
                      "model.bias_gelu_fusion", "model.bias_swiglu_fusion",
                      "model.bias_dropout_fusion", "model.apply_rope_fusion",
                      "precision.grad_accum_dtype"}


def test_every_json_key_maps_to_an_existing_field():
    for path, key in DS_CONFIG_KEYS.items():
        targets = key.field if isinstance(key.field, tuple) else (key.field,)
        for target in targets:
            assert target is None or _field_exists(target), (path, target)
    for _, params, _ in SCHEDULER_TYPES.values():
        for name in params:
            assert f"scheduler.params.{name}" in DS_CONFIG_KEYS


def test_help_defaults_come_from_the_dataclasses():
    ns = build_parser().parse_args([])
    assert (ns.hidden_size, ns.micro_batch_size, ns.zero_stage) == (64, 1, 0)
    assert (ns.lr, ns.split, ns.seed) == (3e-4, "969,30,1", 1234)
    assert ns.use_flash_attn is True and ns.fp16 is False


def test_explicit_parse_holds_only_typed_flags():
    assert vars(parse_args([])) == {}
    args = parse_args(["--micro-batch-size", "4", "--no-flash-attn", "--disable-bias-linear",
                       "--data-path", "0.3", "a", "0.7", "b"])
    assert vars(args) == {"micro_batch_size": 4, "use_flash_attn": False,
                          "disable_bias_linear": True, "data_path": ["0.3", "a", "0.7", "b"]}
    values = flag_values(args)
    assert values["model.use_flash_attn"] == ("--no-flash-attn", False)
    assert values["model.add_bias_linear"] == ("--disable-bias-linear", False)
    assert values["data.data_path"] == ("--data-path", ("0.3", "a", "0.7", "b"))
    assert flag_values(parse_args(["--use-flash-attn"]))["model.use_flash_attn"] == (
        "--use-flash-attn", True)


@pytest.mark.parametrize("argv, part", [
    (["--tensor-model-paralel-size", "2"], "did you mean --tensor-model-parallel-size?"),
    (["--hidden-size", "big"], "argument --hidden-size: invalid int value: 'big'"),
    (["--lr-decay-style", "step"], "invalid choice: 'step'"),
    (["--micro"], "unknown argument '--micro'"),  # abbreviations are not accepted
    (["--model-parallel-size", "2"], "use --tensor-model-parallel-size"),
    (["--fp4-format", "nvfp4"], "FP4 training is not in megazero yet, so "
     "--fp4-format nvfp4 cannot apply; remove it"),
    (["--fp8-format", "e5m2"], "argument --fp8-format: invalid choice: 'e5m2'"),
    (["--data-impl", "lazy"], "--data-impl lazy: megazero takes mmap or infer"),
])
def test_bad_command_lines(argv, part):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert part in str(e.value)


MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8"]
VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
ZBV2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "ZBVZeroBubble",
        "--num-layers", "4", "--untie-embeddings-and-output-weights"]


def error(argv, world_size) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(MODEL + argv, world_size)
    return str(e.value)


# ---------------------------------------------------------------- cross-field checks


@pytest.mark.parametrize("argv, world, parts", [
    (["--num-attention-heads", "6", "--hidden-size", "48", "--tensor-model-parallel-size", "4"],
     4, ["--num-attention-heads 6", "--tensor-model-parallel-size 4", "heads ([1, 2])"]),
    (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     ["--num-query-groups 2", "--tensor-model-parallel-size 4"]),
    (["--hidden-size", "60"], 1, ["--hidden-size 60", "--num-attention-heads 8"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "30"], 4,
     ["--seq-length 30", "--sequence-parallel", "multiple of 4"]),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     ["--num-layers 3", "--pipeline-model-parallel-size 2"]),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "3"], 2, ["= 6", "[1, 2, 4]"]),
    (["--num-layers-per-virtual-pipeline-stage", "2"], 1, ["needs --pipeline-model-parallel-size"]),
    (VPP2 + ["--global-batch-size", "3"], 2,
     ["3 (--global-batch-size / (--micro-batch-size x data-parallel size) = 3 / 1) micro-batches "
      "in groups of 2 (the default group size pp=2) leave a last group of 1",
      "set --microbatch-group-size-per-virtual-pipeline-stage to one of 3,",
      "--global-batch-size 3 rounded to a multiple of 2 (e.g. 2 or 4)"]),
    (VPP2 + ["--global-batch-size", "4", "--micro-batch-size", "2", "--pipeline-model-parallel-"
             "size", "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1"], 8,
     ["needs at least --pipeline-model-parallel-size 4 micro-batches", "got 1 (",
      "= 4 / 4)", "raise --global-batch-size to 16 or more"]),
    (VPP2 + ["--global-batch-size", "4", "--microbatch-group-size-per-virtual-pipeline-stage",
             "1"], 2, ["--microbatch-group-size-per-virtual-pipeline-stage 1 is smaller than "
                       "--pipeline-model-parallel-size 2", "use a value >= 2"]),
    (VPP2 + ["--global-batch-size", "3", "--microbatch-group-size-per-virtual-pipeline-stage",
             "4"], 2, ["--microbatch-group-size-per-virtual-pipeline-stage 4 is larger than the 3",
                       "use a value from 2 to 3 whose last group is empty or >= 2: 3"]),
    (VPP2 + ["--global-batch-size", "7", "--microbatch-group-size-per-virtual-pipeline-stage",
             "3"], 2, ["leave a last group of 1", "(--microbatch-group-size-per-virtual-"
                       "pipeline-stage 3)", "one of 4, 5, 7,", "(e.g. 6 or 9)"]),
    (["--pipeline-schedule", "zbv"], 1, ["--pipeline-schedule zbv needs "
                                         "--pipeline-model-parallel-size > 1 (got 1)"]),
    (ZBV2 + ["--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["--pipeline-schedule zbv places its own two chunks", "drop "
      "--num-layers-per-virtual-pipeline-stage 1"]),
    (ZBV2 + ["--num-layers", "6"], 2, ["--num-layers 6 into 2 x pp = 4 equal chunks",
                                       "multiple of 4 layers"]),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "DualPipeV",
      "--untie-embeddings-and-output-weights", "--num-layers", "4", "--global-batch-size", "3"],
     2, ["--pipeline-schedule dualpipev needs at least 2 x pp = 4 micro-batches", "gives 3"]),
    (VPP2 + ["--delay-wgrad-compute", "--global-batch-size", "4"], 2,
     ["--delay-wgrad-compute runs 1F1B", "drop it with interleaving"]),
    (VPP2 + ["--pipeline-schedule", "1f1b", "--global-batch-size", "4"], 2,
     ["write --pipeline-schedule interleaved"]),
    (["--pipeline-schedule", "zb-h2"], 1, ["--pipeline-schedule", "zb-h2", "zbv"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "5",
      "--pipeline-model-parallel-layout", "E|t*3|t*2L", "--num-layers-per-virtual-pipeline-"
      "stage", "1"], 2, ["with an uneven split give the chunks with "
                         "--pipeline-model-parallel-layout"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "5",
      "--pipeline-model-parallel-layout", "E|t*3|t*2L", "--pipeline-schedule", "zbv",
      "--untie-embeddings-and-output-weights"], 2, ["gives 3 stages; give 4"]),
    (["--pipeline-model-parallel-size", "3", "--num-layers", "5",
      "--decoder-last-pipeline-num-layers", "2"], 3,
     ["--decoder-last-pipeline-num-layers 2 leave 3 of --num-layers 5 layers for 2 other"]),
    (["--recompute-granularity", "full"], 1, ["--recompute-method uniform or block"]),
    (["--group-query-attention"], 1, ["--num-query-groups"]),
    (["--initial-loss-scale", "1000"], 1, ["--initial-loss-scale 1000", "power of two"]),
    (["--zero-stage", "5"], 1, ["--zero-stage", "5", "0, 1, 2, 3"]),
    (["--hidden-sise", "5"], 1, ["'--hidden-sise'", "did you mean --hidden-size?"]),
])
def test_cross_field_errors(argv, world, parts):
    msg = error(argv, world)
    assert all(p in msg for p in parts), msg


def test_both_precision_flags():
    msg = error(["--fp16", "--bf16"], 1)
    assert "--fp16" in msg and "--bf16" in msg and "at most one" in msg


def test_interleaving_layout_and_flags():
    argv = ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "2", "--initial-loss-scale", "65536",
            "--disable-bias-linear", "--no-flash-attn", "--global-batch-size", "4"]
    cfg = load_config(MODEL + argv, world_size=4)
    layout = cfg.layout()
    assert (cfg.vpp, layout.vpp, layout.dp, layout.pp) == (2, 2, 2, 2)
    assert cfg.parallel.microbatch_group_size_per_vp_stage is None  # default: pp
    assert cfg.precision.initial_scale_power == 16
    assert (cfg.model.add_bias_linear, cfg.model.use_flash_attn) == (False, False)


@pytest.mark.parametrize("pp, gbs, group", [(2, 3, 3), (4, 6, 6), (4, 10, 5), (4, 9, 5)])
def test_microbatch_group_size_admits_counts_megatron_core_runs(pp, gbs, group):
    """M micro-batches that are no multiple of pp run with a group size N (pp <= N <= M, last
    group empty or >= pp), as in megatron-core."""
    argv = ["--num-layers", "8", "--pipeline-model-parallel-size", str(pp),
            "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", str(gbs),
            "--microbatch-group-size-per-virtual-pipeline-stage", str(group)]
    cfg = load_config(MODEL[2:] + argv, world_size=pp)
    assert cfg.parallel.microbatch_group_size_per_vp_stage == group
    assert cfg.train.gradient_accumulation_steps == gbs
    msg = error(argv[:-2] + ["--micro-batch-size", "1"], pp)  # the default N = pp refuses it
    assert f"leave a last group of {gbs % pp}" in msg and f"{group}" in msg


def test_sequence_parallel_turned_off_at_tp1():
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect"):
        cfg = load_config(MODEL + ["--sequence-parallel"], world_size=2)
    assert cfg.parallel.sequence_parallel is False


def test_model_preset_and_explicit_flags():
    cfg = load_config(MODEL + ["--model-preset", "llama", "--normalization", "LayerNorm"], 2)
    m = cfg.model
    assert (m.position_embedding_type, m.swiglu, m.add_bias_linear) == ("rope", True, False)
    assert (m.normalization, m.model_preset, m.hidden_size) == ("LayerNorm", "llama", 64)


def test_deepspeed_config_flag_reads_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 3, // per GPU\n'
                    ' "gradient_accumulation_steps": 2}')
    for flag in ("--deepspeed_config", "--deepspeed-config"):
        cfg = load_config(MODEL + [flag, str(path)], world_size=4)
        assert (cfg.train.global_batch_size, cfg.deepspeed_config) == (24, str(path))
    msg = error(["--deepspeed_config", str(tmp_path / "missing.json")], 1)
    assert "--deepspeed_config" in msg and "missing.json" in msg


def test_argv_none_reads_sys_argv_and_world_size_env(monkeypatch):
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *MODEL, "--micro-batch-size", "3",
                                     "--data-path", "0.3 a 0.7 b"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = load_config(None)
    assert (cfg.parallel.world_size, cfg.train.global_batch_size) == (4, 12)
    assert cfg.data.data_path == ("0.3", "a", "0.7", "b")
