"""Flags + DeepSpeed JSON -> MegazeroConfig: seed configs, "auto", the batch triad, rejections."""

import json
import warnings
from pathlib import Path

import pytest

from megazero.config import ConfigError, load_config
from megazero.config.deepspeed import UnimplementedConfigWarning
from megazero.config.jsonc import load_ds_json, parse_ds_json

CONFIGS = Path(__file__).parent / "configs"
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8"]


def load(ds=None, argv=(), world_size=2, fixture=None):
    """The config and the list of keys warned about as unimplemented (in order)."""
    if fixture is not None:
        ds = load_ds_json(CONFIGS / fixture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(MODEL + list(argv), world_size, ds_config=ds)
    keys = [str(w.message).split("'")[1] for w in caught
            if issubclass(w.category, UnimplementedConfigWarning)]
    return cfg, keys


def error(ds=None, argv=(), world_size=2) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(MODEL + list(argv), world_size, ds_config=ds)
    return str(e.value)


# ---------------------------------------------------------------- seed configs from tutorials


def test_seed_zero2_offload_typical():
    cfg, warned = load(fixture="seed000_zero2_offload.json")
    z, p, o = cfg.zero, cfg.precision, cfg.optimizer
    assert (z.stage, z.offload_optimizer.device, z.offload_optimizer.pin_memory) == (2, "cpu", True)
    assert z.allgather_bucket_size == 200_000_000 and type(z.allgather_bucket_size) is int
    assert (z.reduce_bucket_size, z.overlap_comm, z.reduce_scatter) == (200_000_000, True, True)
    assert (p.fp16, p.bf16, p.loss_scale, p.loss_scale_window) == (True, False, 0.0, 1000)
    assert (p.initial_scale_power, p.hysteresis, p.min_loss_scale) == (16, 2, 1.0)
    assert (o.optimizer, o.lr, o.adam_beta1, o.adam_beta2) == ("adamw", 3e-5, 0.8, 0.999)
    assert (o.adam_eps, o.weight_decay) == (1e-8, 3e-7)
    assert (o.scheduler_type, o.lr_decay_style, o.lr_warmup_iters) == ("WarmupLR", "constant", 500)
    assert o.scheduler_params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                  "warmup_num_steps": 500}
    assert (cfg.logging.steps_per_print, cfg.logging.wall_clock_breakdown) == (2000, False)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (1, 2)
    assert warned == []


def test_seed_zero3_fragment_keeps_every_value():
    cfg, warned = load(fixture="seed003_zero3_fragment.json")
    z = cfg.zero
    assert (z.stage, z.offload_param.device, z.offload_param.pin_memory) == (3, "cpu", True)
    assert (z.sub_group_size, z.reduce_bucket_size) == (10**9, 1_000_000)
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (4e6, 1e4)
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (10**9, 10**9)
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert warned == ["zero_optimization.stage3_gather_16bit_weights_on_model_save"]


def test_seed_hf_zero3_auto_filled_from_flags():
    argv = ["--lr", "2e-4", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-6",
            "--weight-decay", "0.1", "--clip-grad", "0.5", "--fp16", "--micro-batch-size", "2",
            "--global-batch-size", "16", "--lr-warmup-iters", "10"]
    cfg, _ = load(fixture="seed003_hf_zero3_auto.json", argv=argv, world_size=4)
    o, t = cfg.optimizer, cfg.train
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (
        2e-4, 0.9, 0.95, 1e-6, 0.1)
    assert (o.clip_grad, cfg.precision.fp16, o.from_ds_config) == (0.5, True, True)
    assert (o.scheduler_type, o.lr_warmup_iters) == ("WarmupLR", 10)
    assert o.scheduler_params == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 2e-4, "warmup_num_steps": 10}
    assert (t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (16, 2, 2)
    assert not hasattr(cfg, "ds_config")  # the dataclasses are the only copy of the settings
    # ZeRO-3 sizes that depend on the model, filled from --hidden-size 64 as HF does
    z = cfg.zero
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size) == (64 * 64, int(0.9 * 64 * 64))
    assert z.stage3_param_persistence_threshold == 640


def test_auto_without_flags_takes_the_defaults():
    cfg, _ = load(fixture="seed003_hf_zero2_auto.json")
    assert (cfg.precision.fp16, cfg.optimizer.lr, cfg.optimizer.clip_grad) == (False, 3e-4, 1.0)
    assert cfg.train.global_batch_size == 2  # micro 1 x accumulation 1 x dp 2


def test_seed_legacy_zero_true_and_adam_type():
    cfg, _ = load(fixture="seed002_legacy_zero_true.json")
    assert cfg.zero.stage == 1  # "zero_optimization": true is DeepSpeed's old spelling of stage 1
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 4)
    assert (cfg.optimizer.optimizer, cfg.optimizer.lr, cfg.precision.fp16) == (
        "adamw", 0.00015, True)


def test_seed_bfloat16_spelling_checkpoint_block_and_float_steps():
    cfg, warned = load(fixture="seed003_zero2_node_local_storage.json")
    assert cfg.precision.bf16 is False
    assert cfg.logging.steps_per_print == 100000 and type(cfg.logging.steps_per_print) is int
    assert cfg.zero.reduce_bucket_size == 64 * 64
    # the seed's "checkpoint": {"use_node_local_storage": true}: known, not acted on
    assert warned == ["checkpoint.use_node_local_storage"]


@pytest.mark.parametrize("fixture, world, check, warned", [
    ("seed003_pipeline_alexnet.json", 2,
     lambda c: (c.train.gradient_accumulation_steps, c.optimizer.optimizer) == (16, "adamw"), []),
    ("seed003_autotuning.json", 2, lambda c: c.precision.fp16, ["autotuning"]),
    ("seed003_stage0.json", 1, lambda c: c.zero.stage == 0, []),
    ("seed003_stage1.json", 1, lambda c: c.zero.stage == 1, []),
    ("seed003_communication_dtype.json", 1,
     lambda c: c.precision.communication_data_type == "fp32", []),
    ("seed003_force_ds_cpu_optimizer.json", 1, lambda c: c.zero.stage == 0,
     ["zero_force_ds_cpu_optimizer"]),
    ("seed003_gather_16bit.json", 1, lambda c: c.zero.stage3_gather_16bit_weights_on_model_save,
     ["zero_optimization.stage3_gather_16bit_weights_on_model_save"]),
    ("seed003_amp_fp16_fragments.json", 1,
     lambda c: c.precision.fp16 and not c.precision.consecutive_hysteresis,
     ["amp"]),  # "auto_cast": false is the default: nothing to warn about
])
def test_other_seed_configs_load(fixture, world, check, warned):
    cfg, keys = load(fixture=fixture, world_size=world)
    assert check(cfg)
    assert keys == warned


@pytest.mark.parametrize("fixture, line, fix", [
    ("bad_seed000_placeholders.json", 35, "write exactly one value"),
    ("bad_seed000_unquoted_auto.json", 41, 'write "auto" in double quotes'),
    ("bad_seed003_python_variables.json", 2, "'GLOBAL_BATCH_SIZE' is not a JSON value"),
])
def test_invalid_seed_json_names_line_and_fix(fixture, line, fix):
    with pytest.raises(ConfigError) as e:
        load_ds_json(CONFIGS / fixture)
    assert f"line {line}," in str(e.value) and fix in str(e.value)
    assert fixture in str(e.value)


@pytest.mark.parametrize("fixture", ["bad_seed003_missing_commas.json",
                                     "bad_seed004_trailing_comma.json"])
def test_what_deepspeeds_hjson_reader_accepts_is_accepted(fixture):
    """DeepSpeed reads its config with hjson: trailing commas and members separated by
    newlines only are fine there, so they are fine here."""
    import hjson

    text = (CONFIGS / fixture).read_text()
    assert load_ds_json(CONFIGS / fixture) == json.loads(json.dumps(hjson.loads(text)))


@pytest.mark.parametrize("text, line, fix", [
    ('{"a": 1,\n', 1, "the file ends inside a block"),
    ('{"zero_optimization": {"stage": 2\n', 1, "the file ends inside a block"),
    ('{"a": 1 "b": 2}', 1, "a comma is missing"),
    ('{\n"a": True,\n}', 2, "True is Python"),
])
def test_broken_json_still_names_line_and_fix(text, line, fix):
    with pytest.raises(ConfigError) as e:
        parse_ds_json(text)
    assert f"line {line}," in str(e.value) and fix in str(e.value)


def test_seed_template_loads_once_its_placeholders_are_filled():
    text = (CONFIGS / "bad_seed000_placeholders.json").read_text()
    ds = parse_ds_json(text.replace("[0|1|2|3]", "3").replace('"[cpu|nvme]"', '"cpu"'))
    cfg, warned = load(ds, ["--bf16"])
    assert (cfg.zero.stage, cfg.zero.sub_group_size, cfg.precision.bf16) == (3, 10**12, True)
    assert (cfg.zero.offload_param.device, cfg.zero.elastic_checkpoint) == ("cpu", True)
    # 18 before NVMe offload landed: its six keys (nvme_path, buffer_count x2, buffer_size,
    # max_in_cpu) no longer warn; 12 until keys given their default value stopped warning
    assert len(warned) == len(set(warned)) == 11
    assert cfg.zero.offload_param.buffer_size == 10**8  # read, used once device is "nvme"
    assert {"zero_optimization.offload_optimizer.ratio", "optimizer.params.freeze_step",
            "zero_optimization.zero_quantized_weights", "dump_state"} <= set(warned)


def test_seed_with_misspelled_key_suggests_the_known_one():
    msg = error(load_ds_json(CONFIGS / "bad_seed003_unknown_key.json"))
    assert "'gradient_accumulation'" in msg
    assert "did you mean 'gradient_accumulation_steps'?" in msg


# ---------------------------------------------------------------- JSON text


def test_comments_are_stripped_but_strings_kept():
    text = ('{\n  // a comment with "quotes"\n  "tensorboard": {"enabled": true, /* block\n'
            ' comment */ "output_path": "http://host//x/*y*/", "job_name": "j"}\n}')
    ds = parse_ds_json(text)
    assert ds == {"tensorboard": {"enabled": True, "output_path": "http://host//x/*y*/",
                                  "job_name": "j"}}
    cfg, _ = load(ds)
    assert (cfg.logging.tensorboard_dir, cfg.logging.tensorboard_job_name) == (
        "http://host//x/*y*/", "j")


@pytest.mark.parametrize("text, expected", [
    ('{\n"zero_optimization": {\n  "stage": stage\n}}', "line 3, column 12"),
    ('{"fp16": {"enabled": True}}', "True is Python, not JSON"),
    ('{"a": 1 /* open', "unterminated /* comment starting at line 1, column 9"),
    ('{"fp16": {}, "fp16": {}}', "key 'fp16' appears twice"),
    ('[1, 2]', "the top level must be a JSON object"),
    ("{'fp16': {}}", "JSON strings use double quotes"),
    ('{\n  # note\n}', "line 2, column 3"),
    ('{"train_batch_size": 8,\n"fp16": {"enabled": None},\n}', "line 2, column 21"),
])
def test_json_syntax_errors(text, expected):
    with pytest.raises(ConfigError) as e:
        parse_ds_json(text)
    assert expected in str(e.value)


# ---------------------------------------------------------------- rejections


@pytest.mark.parametrize("ds, parts", [
    ({"trian_batch_size": 8}, ["'trian_batch_size'", "did you mean 'train_batch_size'?"]),
    ({"zero_optimization": {"reduce_bucket_sise": 1}},
     ["'zero_optimization.reduce_bucket_sise'", "'zero_optimization.reduce_bucket_size'?"]),
    ({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
     ["'zero_optimization.offload_optimizer.pin_memory'?"]),
    ({"fp16": {"loss_scale_windw": 1}}, ["'fp16.loss_scale_window'?"]),
    ({"bf16": {"enable": True}}, ["'bf16.enabled'?"]),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     ["'optimizer.params.weight_decay'?"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
     ["'scheduler.params.warmup_num_steps'?"]),
    ({"tensorboard": {"output": "x"}}, ["'tensorboard.output_path'?"]),
    ({"wandb": {"projct": "p"}}, ["'wandb.project'?"]),
    ({"csv_monitor": {"job": "j"}}, ["'csv_monitor.job_name'?"]),
    ({"checkpoint": {"use_node_local_storag": True}}, ["'checkpoint.use_node_local_storage'?"]),
    ({"zero_optimization": {"xyz": 1}}, ["known keys in 'zero_optimization':", "overlap_comm"]),
])
def test_unknown_keys_suggest_the_closest(ds, parts):
    msg = error(ds)
    assert "unknown key" in msg and all(p in msg for p in parts), msg


@pytest.mark.parametrize("ds, parts", [
    ({"zero_optimization": {"reduce_bucket_size": "big"}},
     ["zero_optimization.reduce_bucket_size", '"big"', "expected an integer"]),
    ({"zero_optimization": {"allgather_bucket_size": 2.5}}, ["2.5", "expected an integer"]),
    ({"zero_optimization": {"overlap_comm": "yes"}}, ["overlap_comm", "true or false"]),
    ({"train_batch_size": True}, ["train_batch_size", "expected an integer"]),
    ({"optimizer": {"params": {"betas": [0.9]}}}, ["optimizer.params.betas", "two numbers"]),
    ({"fp16": []}, ["fp16", "expected an object"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "4", "0, 1, 2, 3"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "[cpu|nvme]"}}},
     ["offload_param.device", "[cpu|nvme]", '"none", "cpu", "nvme"']),
    ({"aio": {"queue_depth": "deep"}}, ["aio.queue_depth", '"deep"', "expected an integer"]),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 4}},
     ["aio.thread_count: 2", "aio.intra_op_parallelism: 4", "set the same thing differently"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     ["fp16.enabled", "bf16.enabled", "at most one"]),
    ({"optimizer": {"type": "Adagrad"}}, ["optimizer.type", "'Adagrad'", "Adam, AdamW, SGD, Lion"]),
    ({"scheduler": {"type": "WarmupLr"}}, ["scheduler.type", "did you mean 'WarmupLR'?"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 9}}},
     ["scheduler.params.total_num_steps is not a parameter of WarmupLR", "warmup_max_lr"]),
    ({"communication_data_type": "fp8"}, ["communication_data_type", "fp8", '"fp32"']),
    ({"bf16": {}, "bfloat16": {}}, ['"bfloat16"', 'keep "bf16"']),
])
def test_wrong_values_name_key_value_and_expectation(ds, parts):
    msg = error(ds)
    assert all(p in msg for p in parts), msg


def test_integral_floats_are_integers():
    cfg, _ = load({"zero_optimization": {"stage": 2.0, "reduce_bucket_size": 5e7}})
    assert cfg.zero.stage == 2 and cfg.zero.reduce_bucket_size == 50_000_000
    assert type(cfg.zero.reduce_bucket_size) is int


# ---------------------------------------------------------------- flag vs JSON


@pytest.mark.parametrize("argv, ds, parts", [
    (["--micro-batch-size", "4"], {"train_micro_batch_size_per_gpu": 8},
     ["--micro-batch-size 4", "train_micro_batch_size_per_gpu: 8"]),
    (["--zero-stage", "2"], {"zero_optimization": {"stage": 3}},
     ["--zero-stage 2", "zero_optimization.stage: 3"]),
    (["--fp16"], {"fp16": {"enabled": False}}, ["--fp16 on the command line", "fp16.enabled"]),
    (["--lr", "1e-3"], {"optimizer": {"params": {"lr": 3e-4}}},
     ["--lr 0.001", "optimizer.params.lr: 0.0003"]),
    (["--lr-decay-style", "cosine"], {"scheduler": {"type": "WarmupLR"}},
     ['--lr-decay-style "cosine"', "scheduler.type 'WarmupLR'"]),
    ([], {"optimizer": {"params": {"lr": 1e-4}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-4}}},
     ["optimizer.params.lr: 0.0001", "scheduler.params.warmup_max_lr: 0.0002"]),
])
def test_flag_and_json_disagree(argv, ds, parts):
    msg = error(ds, argv)
    assert all(p in msg for p in parts), msg


def test_flag_and_json_agree_or_auto():
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": "auto"}}
    cfg, _ = load(ds, ["--micro-batch-size", "4", "--zero-stage", "2"])
    assert (cfg.train.micro_batch_size, cfg.zero.stage) == (4, 2)


# ---------------------------------------------------------------- batch triad


@pytest.mark.parametrize("argv, ds, world, triad", [
    (["--micro-batch-size", "4", "--global-batch-size", "64", "--tensor-model-parallel-size", "2"],
     None, 8, (4, 64, 4)),  # dp = 8 / 2 = 4 -> accumulation derived
    (["--tensor-model-parallel-size", "2"], {"train_batch_size": 64,
                                             "gradient_accumulation_steps": 2}, 8, (8, 64, 2)),
    (["--pipeline-model-parallel-size", "2"],
     {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 8, (2, 24, 3)),
    ([], {"train_batch_size": 32}, 4, (8, 32, 1)),  # DeepSpeed: lone train_batch_size, no accum.
    (["--global-batch-size", "32"], None, 4, (1, 32, 8)),  # Megatron: micro-batch defaults to 1
    ([], None, 4, (1, 4, 1)),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 8, (4, 16, 2)),  # dp excludes TP and PP ranks
])
def test_batch_triad_derivation(argv, ds, world, triad):
    cfg, _ = load(ds, argv, world)
    t = cfg.train
    assert (t.micro_batch_size, t.global_batch_size, t.gradient_accumulation_steps) == triad
    assert cfg.parallel.dp == world // (cfg.parallel.tp * cfg.parallel.pp)


def test_batch_triad_inconsistent():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2}
    msg = error(ds, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                world_size=8)
    for part in ("train_batch_size 32", "train_micro_batch_size_per_gpu 4",
                 "gradient_accumulation_steps 2", "dp_size 2", "world size 8",
                 "set train_batch_size (--global-batch-size) to 16",
                 "gradient_accumulation_steps to 4"):
        assert part in msg, msg


def test_global_batch_not_divisible():
    msg = error(argv=["--global-batch-size", "30", "--micro-batch-size", "4"], world_size=2)
    assert "30 is not divisible by" in msg and "= 8" in msg and "e.g. 24 or 32" in msg


def test_world_size_not_divisible_by_model_parallel():
    msg = error(argv=["--tensor-model-parallel-size", "4"], world_size=6)
    assert "world size 6" in msg and "= 4" in msg


def test_one_warning_per_unimplemented_key_per_load():
    ds = {"dump_state": True, "zero_optimization": {"stage": 1, "round_robin_gradients": True},
          "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False,
                             "recompute_fwd_factor": 0.5},
          "steps_per_print": 5, "wall_clock_breakdown": True}
    for _ in range(2):  # no state kept between loads: the second load warns again
        _, warned = load(json.loads(json.dumps(ds)))
        assert sorted(warned) == ["dump_state", "flops_profiler.recompute_fwd_factor",
                                  "zero_optimization.round_robin_gradients"]


def test_unimplemented_scheduler_type_warns_once():
    ds = {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5}}}
    cfg, warned = load(ds)
    assert warned.count("scheduler.type") == 1 and cfg.optimizer.scheduler_type is None
    assert warned.count("scheduler.params.cycle_min_lr") == 1


# ---------------------------------------------------------------- schedulers and monitors


@pytest.mark.parametrize("argv, scheduler, params", [
    (["--train-iters", "100", "--lr", "1e-3"],
     {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": "auto",
                                           "warmup_num_steps": 7}},
     {"total_num_steps": 100, "warmup_max_lr": 1e-3, "warmup_num_steps": 7}),
    (["--lr-decay-iters", "50", "--lr", "1e-3", "--min-lr", "1e-4"],
     {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "cos_min_ratio": "auto",
                                            "warmup_min_ratio": "auto"}},
     {"total_num_steps": 50, "cos_min_ratio": 0.1, "warmup_min_ratio": 0.0}),
])
def test_scheduler_auto_params(argv, scheduler, params):
    cfg, _ = load({"scheduler": scheduler}, argv)
    assert cfg.optimizer.scheduler_params == pytest.approx(params)
    assert cfg.optimizer.lr_decay_style == {"WarmupDecayLR": "linear",
                                            "WarmupCosineLR": "cosine"}[scheduler["type"]]


def test_scheduler_total_steps_auto_needs_a_length():
    msg = error({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert "total_num_steps" in msg and "--train-iters" in msg


def test_tensorboard_wandb_csv_blocks():
    ds = {"tensorboard": {"enabled": True, "job_name": "run1"},
          "wandb": {"enabled": True, "project": "p", "team": "t"},
          "csv_monitor": {"enabled": False, "output_path": "csv/"}}
    cfg, warned = load(ds)
    lg = cfg.logging
    assert (lg.tensorboard_dir, lg.tensorboard_job_name) == (".", "run1")
    assert lg.wandb == {"enabled": True, "project": "p", "team": "t"}
    assert lg.csv_monitor == {"enabled": False, "output_path": "csv/"} and warned == []
    off, _ = load({"tensorboard": {"enabled": False, "output_path": "tb/"}},
                  ["--tensorboard-dir", "runs/"])
    assert off.logging.tensorboard_dir == "runs/"
    msg = error({"tensorboard": {"enabled": True, "output_path": "tb/"}},
                ["--tensorboard-dir", "runs/"])
    assert '--tensorboard-dir "runs/"' in msg and 'tensorboard.output_path: "tb/"' in msg


@pytest.mark.parametrize("argv, ds, part", [
    (["--lr", "-1"], None, "--lr (optimizer.params.lr): got -1.0"),
    ([], {"optimizer": {"params": {"betas": [0.9, 1.5]}}}, "--adam-beta2"),
    (["--train-iters", "5", "--train-samples", "10"], None, "give only one of them"),
    ([], {"gradient_clipping": -1}, "--clip-grad (gradient_clipping): got -1.0"),
])
def test_optimizer_and_length_values(argv, ds, part):
    assert part in error(ds, argv)
