"""Typed, frozen configuration: one :class:`MegazeroConfig` per run, validated in one place.

Its sections are the single source of truth for every setting: the model
(:mod:`megazero.config.model_schema`, with MoE in :mod:`megazero.config.moe_schema`), the
optimizer, precision and ZeRO (:mod:`megazero.config.optim_schema`), and the layout, data,
training, logging and checkpointing (:mod:`megazero.config.sections`). Each section checks its
own values; :func:`validate` here checks what involves more than one. They are filled from
Megatron-style command-line flags and an optional DeepSpeed-style JSON config by
:func:`megazero.config.load_config`; components receive the sub-config they need.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from megazero.config.layout import ParallelLayout
from megazero.config.model_schema import (
    ModelConfig,
    check_context_parallel,
    check_tensor_parallel_split,
)
from megazero.config.observability_schema import CommsLoggerSettings, FlopsProfilerSettings
from megazero.config.optim_schema import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.rules import (
    V_SCHEDULES,
    check,
    check_microbatch_groups,
    check_pipeline_schedule,
    check_rampup,
    divisors,
    parse_pipeline_layout,
    pipeline_chunks,
    stage_layer_counts,
)
from megazero.config.sections import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    TrainConfig,
)
from megazero.errors import ConfigError


@dataclass(frozen=True)
class MegazeroConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deepspeed: bool = False  # Megatron-DeepSpeed's --deepspeed switch; accepted, has no effect
    deepspeed_config: str | None = None  # path of the DeepSpeed JSON config, if one was given

    def __post_init__(self) -> None:
        validate(self)

    @property
    def vpp(self) -> int | None:
        """Virtual pipeline chunks per stage (interleaved 1F1B), or None without interleaving."""
        if self.parallel.pipeline_schedule in V_SCHEDULES:
            return 2  # the V: chunk 0 at stage r, chunk 1 at stage 2 pp - 1 - r
        if self.parallel.pipeline_model_parallel_layout is not None:
            stages = len(parse_pipeline_layout(self.parallel.pipeline_model_parallel_layout,
                                               self.model.num_layers))
            return stages // self.parallel.pp if stages > self.parallel.pp else None
        per_chunk = self.parallel.num_layers_per_virtual_pipeline_stage
        return None if per_chunk is None else self.model.num_layers // self.parallel.pp // per_chunk

    def layout(self) -> ParallelLayout:
        """The :class:`~megazero.config.layout.ParallelLayout` of this run (needs the world
        size)."""
        if self.parallel.world_size is None:
            raise ConfigError("the layout needs the world size; build the config with "
                              "load_config(argv, world_size)")
        return ParallelLayout(self.parallel.world_size, self.parallel.tp, self.parallel.pp,
                              self.vpp, self.parallel.cp,
                              ep=self.parallel.expert_model_parallel_size,
                              etp=self.parallel.expert_tensor_parallel_size)


@functools.cache
def field_choices(path: str) -> tuple[Any, ...] | None:
    """The values a ``Literal``-typed field such as ``model.normalization`` accepts (None is
    left out: it is the "not given" default), or None for a field of another type."""
    cls: Any = MegazeroConfig
    hint: Any = None
    for part in path.split("."):
        hint = typing.get_type_hints(cls)[part]
        cls = hint
    literals = [a for a in (typing.get_args(hint) if typing.get_origin(hint) is not Literal
                            else (hint,)) if typing.get_origin(a) is Literal]
    values = tuple(v for lit in literals for v in typing.get_args(lit))
    return values or None


def check_moe_layout(cfg: MegazeroConfig) -> None:
    """MoE against the parallel layout: experts split evenly over the expert-parallel ranks,
    expert parallelism only with experts, tensor parallelism only with sequence parallelism
    (each TP rank then routes its own tokens; without SP they would be routed twice)."""
    moe, p = cfg.model.moe, cfg.parallel
    ep = p.expert_model_parallel_size
    if moe.num_experts is None:
        # with --use-checkpoint-args the experts may come from the checkpoint: the layout is
        # checked again once its model settings are in (megazero.training.resume_checks)
        etp = p.expert_tensor_parallel_size
        check(ep * etp == 1 or cfg.checkpoint.use_checkpoint_args,
              f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} needs a "
              "Mixture-of-Experts model; add --num-experts E (or --use-checkpoint-args with "
              "--load of an MoE checkpoint) or drop the flags")
        return
    check(moe.num_experts % ep == 0,
          f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size "
          f"{ep}; use an expert-parallel size from "
          f"{[d for d in divisors(moe.num_experts) if p.world_size % (d * p.pp) == 0]}"
          if p.world_size is not None else f"{divisors(moe.num_experts)}")
    check(p.tp == 1 or p.sequence_parallel,
          f"--num-experts with --tensor-model-parallel-size {p.tp} needs --sequence-parallel "
          "(each TP rank routes its own slice of the tokens); add --sequence-parallel")
    etp = p.expert_tensor_parallel_size
    ffn = moe.moe_ffn_hidden_size or cfg.model.ffn_size
    check(ffn % etp == 0,
          f"--moe-ffn-hidden-size {ffn} is not divisible by --expert-tensor-parallel-size "
          f"{etp} (each rank holds 1/{etp} of every expert's hidden units); use a size from "
          f"{[d for d in divisors(ffn) if d <= 64]} or another hidden size")
    lamb = cfg.optimizer.optimizer in ("lamb", "onebitlamb")
    check(not lamb or ep * etp == 1,
          f"optimizer {cfg.optimizer.optimizer} (optimizer.type) with "
          f"--expert-model-parallel-size {ep} x "
          f"--expert-tensor-parallel-size {etp}: Lamb's whole-parameter norms are not summed "
          "over the expert groups; use adam/adamw, or expert-parallel sizes 1")
    freq = moe.moe_layer_freq
    check(isinstance(freq, int) or len(freq) == cfg.model.num_layers,
          f"--moe-layer-freq lists {0 if isinstance(freq, int) else len(freq)} layers but "
          f"--num-layers is {cfg.model.num_layers}; give one 0/1 per layer")


def check_ep_overlap(cfg: MegazeroConfig) -> None:
    """``--overlap-moe-expert-parallel-comm`` (combined 1F1B, :mod:`megazero.combined_1f1b`)
    against the layout: all-to-alls to hide (expert parallel > 1, the alltoall dispatcher),
    a schedule whose steady state pairs a forward with a backward (no pipelining, the
    interleaved schedule or DualPipeV: megatron-core asks for virtual stages too), and no
    recomputation (a recomputed forward would run inside the other micro-batch's turn)."""
    p, moe = cfg.parallel, cfg.model.moe
    if not p.overlap_moe_expert_parallel_comm:
        return
    flag = "--overlap-moe-expert-parallel-comm"
    ep = p.expert_model_parallel_size
    check(moe.num_experts is not None and ep > 1,
          f"{flag} hides the expert-parallel all-to-alls, and --expert-model-parallel-size {ep}"
          f"{'' if moe.num_experts is not None else ' without --num-experts'} has none: set "
          "--expert-model-parallel-size > 1 (with --num-experts) or drop the flag")
    check(moe.moe_token_dispatcher_type == "alltoall",
          f"{flag} pairs the all-to-alls of two micro-batches, and --moe-token-dispatcher-type "
          f"{moe.moe_token_dispatcher_type} has none: add --moe-token-dispatcher-type alltoall "
          "or drop the flag")
    check(not moe.moe_shared_expert_overlap,
          f"{flag} with --moe-shared-expert-overlap: the dispatch is already hidden under the "
          "other micro-batch's compute; drop --moe-shared-expert-overlap")
    check(p.recompute_granularity != "full" and p.recompute_method is None,
          f"{flag} with --recompute-granularity {p.recompute_granularity}"
          f"{'' if p.recompute_method is None else ' --recompute-method ' + p.recompute_method}"
          ": a recomputed forward would run inside the other micro-batch's turn; use "
          "--recompute-granularity selective without --recompute-method, or no recompute")
    schedule = p.pipeline_schedule
    if p.pp > 1:
        check(schedule == "dualpipev" or (schedule in (None, "interleaved")
                                          and (cfg.vpp or 1) > 1),
              f"{flag} at --pipeline-model-parallel-size {p.pp} pairs each steady-state "
              "forward with a backward of another micro-batch, which only the interleaved "
              "schedule and DualPipeV run back to back: add "
              "--num-layers-per-virtual-pipeline-stage N (interleaved) or "
              "--pipeline-schedule dualpipev"
              f"{'' if schedule in (None, 'interleaved') else f' instead of {schedule}'}")


def check_fp8(cfg: MegazeroConfig) -> None:
    """FP8 against the model and ZeRO: the bf16 layers fit in the model, FP8 parameter
    gathers need a ZeRO stage that gathers parameters (1-3), 16-bit compute copies at
    stages 1-2 (they become the decoded FP8 weights) and current scaling at stage 3."""
    pr = cfg.precision
    check(pr.fp8_format is not None or not cfg.logging.log_fp8_amax,
          "--log-fp8-amax without --fp8-format: no tensor runs FP8; add --fp8-format hybrid "
          "(or e4m3), or drop --log-fp8-amax")
    if pr.fp8_format is None:
        return
    check(not cfg.parallel.tp_comm_overlap,
          "--tp-comm-overlap with --fp8-format: the overlapped GEMMs run in 16 bits only; drop "
          "--tp-comm-overlap (or --fp8-format)")
    n = cfg.model.num_layers
    if pr.first_last_layers_bf16:
        start, end = pr.num_layers_at_start_in_bf16, pr.num_layers_at_end_in_bf16
        check(start + end <= n, f"--num-layers-at-start-in-bf16 {start} + "
              f"--num-layers-at-end-in-bf16 {end} exceed --num-layers {n}; keep their sum "
              f"<= {n}")
    if pr.fp8_param_gather:
        check(cfg.zero.stage > 0,
              "--fp8-param-gather with --zero-stage 0: no parameters are gathered; add "
              "--use-distributed-optimizer (or --zero-stage 1, 2 or 3), or drop "
              "--fp8-param-gather")
        check(cfg.zero.stage == 3 or pr.bf16 or pr.fp16,
              f"--fp8-param-gather with --zero-stage {cfg.zero.stage} and fp32 parameters: "
              "the gathered FP8 weights replace the 16-bit compute copy of the fp32 masters, "
              "and fp32 training has no such copy; add --bf16, or drop --fp8-param-gather")
        check(cfg.zero.stage != 3 or pr.fp8_recipe == "tensorwise",
              f"--fp8-param-gather with --fp8-recipe {pr.fp8_recipe} at --zero-stage 3: ZeRO-3 "
              "gathers take one current scale per weight; use --fp8-recipe tensorwise, "
              "--use-distributed-optimizer (ZeRO-1) instead of ZeRO-3, or drop "
              "--fp8-param-gather")


def layer_counts(cfg: MegazeroConfig) -> list[int] | None:
    """Transformer layers per virtual stage (stage order) under Megatron's uneven-split
    flags; ``None`` for the even split."""
    p = cfg.parallel
    if not p.uneven_split:
        return None
    return stage_layer_counts(
        cfg.model.num_layers, p.pp * (cfg.vpp or 1), p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers, p.account_for_embedding_in_pipeline_split,
        p.account_for_loss_in_pipeline_split, p.pipeline_model_parallel_layout)


def check_uneven_split(cfg: MegazeroConfig) -> None:
    p = cfg.parallel
    check(p.pp > 1, "the uneven pipeline-split flags need --pipeline-model-parallel-size > 1")
    check(p.num_layers_per_virtual_pipeline_stage is None,
          "--num-layers-per-virtual-pipeline-stage splits evenly; with an uneven split give "
          "the chunks with --pipeline-model-parallel-layout (pp x chunks stages) instead")
    check(p.pipeline_model_parallel_layout is None or not (
        p.decoder_first_pipeline_num_layers is not None
        or p.decoder_last_pipeline_num_layers is not None
        or p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split),
        "--pipeline-model-parallel-layout gives every stage's layers; drop the "
        "--decoder-first/last-pipeline-num-layers and --account-for-* flags with it")
    if p.pipeline_model_parallel_layout is not None:
        stages = len(parse_pipeline_layout(p.pipeline_model_parallel_layout,
                                           cfg.model.num_layers))
        want = 2 * p.pp if p.pipeline_schedule in V_SCHEDULES else None
        check(stages % p.pp == 0 and (want is None or stages == want),
              f"--pipeline-model-parallel-layout gives {stages} stages; give "
              f"{want if want else f'a multiple of --pipeline-model-parallel-size {p.pp}'}")
    layer_counts(cfg)


def validate(cfg: MegazeroConfig) -> None:
    """Checks that involve more than one sub-config; each message names the numbers and the fix."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp = p.tp, p.pp
    check_tensor_parallel_split(m, tp, p.sequence_parallel, p.world_size, pp * p.cp)
    check_context_parallel(m, tp, p.cp, p.sequence_parallel, p.cp_comm_type)
    check_moe_layout(cfg)
    if m.mtp_num_layers:
        check(not t.calculate_per_token_loss, "--mtp-num-layers with --calculate-per-token-loss "
              "is not supported (the MTP losses are per-micro-batch means); drop one of them")
    d = cfg.data
    for flag, on in (("--reset-position-ids", d.reset_position_ids),
                     ("--reset-attention-mask", d.reset_attention_mask)):
        check(not on or pp == 1, f"{flag} with --pipeline-model-parallel-size {pp}: the "
              "documents of a packed sequence are known where it is drawn, on the first stage "
              "only; use one pipeline stage or drop the flag")
    check(not d.reset_attention_mask or m.attention_dropout == 0,
          f"--reset-attention-mask with --attention-dropout {m.attention_dropout}: packed "
          "attention runs without dropout; pass --attention-dropout 0")
    check_fp8(cfg)
    check_ep_overlap(cfg)
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    if p.uneven_split:
        check_uneven_split(cfg)
    else:
        pipeline_chunks(m.num_layers, pp, per_chunk)
    check_pipeline_schedule(
        p.pipeline_schedule, pp, per_chunk,
        2 * pp if p.uneven_split else m.num_layers, p.delay_wgrad_compute,
        t.global_batch_size // (t.micro_batch_size * p.dp)
        if p.world_size is not None and t.global_batch_size is not None else None)
    if per_chunk is not None:
        count = step = None
        if p.world_size is not None and t.global_batch_size is not None:
            step = t.micro_batch_size * p.dp
            if step > 0 and t.global_batch_size % step == 0:
                count = t.global_batch_size // step
        check_microbatch_groups(pp, count, p.microbatch_group_size_per_vp_stage, step)
        if t.rampup_batch_size is not None and step and count is not None:
            for g in check_rampup(t.rampup_batch_size, t.global_batch_size or step,
                                  t.micro_batch_size, p.dp):
                check_microbatch_groups(pp, g // step, p.microbatch_group_size_per_vp_stage,
                                        step)
    if t.rampup_batch_size is not None:
        check(t.global_batch_size is not None, "--rampup-batch-size needs --global-batch-size "
              "(the size the ramp reaches)")
        check_rampup(t.rampup_batch_size, t.global_batch_size or 0, t.micro_batch_size,
                     p.dp if p.world_size is not None else None)
    check(t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got "
          f"{t.manual_gc_interval}")
    check(t.max_nonfinite_steps >= 1, f"--max-nonfinite-steps must be >= 1 (non-finite "
          f"steps in a row before the run stops), got {t.max_nonfinite_steps}")
    check(t.spike_factor == 0 or t.spike_factor > 1, f"--spike-factor must be 0 (off) or > 1 "
          f"(how many times the recent median a spike is), got {t.spike_factor}")
    check(t.max_spike_steps >= 1, f"--max-spike-steps must be >= 1 (spiked steps in a row "
          f"before the run stops), got {t.max_spike_steps}")
    check(t.spike_window >= 1, f"--spike-window must be >= 1 (sound steps the spike check "
          f"takes the median over), got {t.spike_window}")
    lg = cfg.logging
    if lg.comms_logger:
        CommsLoggerSettings.from_block(lg.comms_logger)
    if lg.flops_profiler:
        FlopsProfilerSettings.from_block(lg.flops_profiler)
    if lg.log_straggler:
        check(lg.straggler_minmax_count >= 1 and lg.straggler_patience >= 1
              and lg.straggler_factor > 1, f"--straggler-minmax-count "
              f"{lg.straggler_minmax_count} and --straggler-patience {lg.straggler_patience} "
              f"must be >= 1 and --straggler-factor {lg.straggler_factor} > 1")
    if lg.profile:
        check(1 <= lg.profile_step_start < lg.profile_step_end, f"--profile-step-start "
              f"{lg.profile_step_start} and --profile-step-end {lg.profile_step_end}: profiling "
              f"covers iterations [start, end), so give 1 <= start < end")
    check(p.distributed_timeout_minutes > 0, f"--distributed-timeout-minutes must be > 0, got "
          f"{p.distributed_timeout_minutes}")
    check(t.micro_batch_size >= 1, f"--micro-batch-size (train_micro_batch_size_per_gpu) must "
          f"be >= 1, got {t.micro_batch_size}")
    check(t.train_iters is None or t.train_samples is None,
          f"--train-iters {t.train_iters} and --train-samples {t.train_samples} are both given; "
          f"give only one of them")
    o = cfg.optimizer
    check(o.decoupled_min_lr is None or o.decoupled_lr is not None,
          f"--decoupled-min-lr {o.decoupled_min_lr} needs --decoupled-lr (the peak learning rate "
          "of the embedding and output layer)")
    check(t.train_tokens is None or t.train_tokens > 0,
          f"--train-tokens must be > 0, got {t.train_tokens}")
    for flag, tokens in (("--lr-warmup-tokens", o.lr_warmup_tokens),
                         ("--lr-decay-tokens", o.lr_decay_tokens)):
        check(tokens is None or tokens >= 0, f"{flag} must be >= 0, got {tokens}")
    check(t.empty_unused_memory_level in (0, 1, 2), f"--empty-unused-memory-level must be 0, 1 "
          f"or 2, got {t.empty_unused_memory_level}")
    d = cfg.data
    if d.per_split_paths:
        check(not d.data_path and not d.mock_data,
              "--train-data-path / --valid-data-path / --test-data-path give each split its own "
              f"corpus; drop {'--mock-data' if d.mock_data else '--data-path'} (or use "
              "--data-path with --split instead)")
        check(bool(d.train_data_path), "--valid-data-path / --test-data-path need "
              "--train-data-path (the corpus to train on)")
    for flag, value, ok in (
            ("--lr (optimizer.params.lr)", o.lr, o.lr >= 0),
            ("--decoupled-lr", o.decoupled_lr, o.decoupled_lr is None or o.decoupled_lr >= 0),
            ("--decoupled-min-lr", o.decoupled_min_lr,
             o.decoupled_min_lr is None or o.decoupled_min_lr >= 0),
            ("--min-lr", o.min_lr, o.min_lr >= 0),
            ("--adam-beta1 (optimizer.params.betas[0])", o.adam_beta1, 0 <= o.adam_beta1 < 1),
            ("--adam-beta2 (optimizer.params.betas[1])", o.adam_beta2, 0 <= o.adam_beta2 < 1),
            ("--adam-eps (optimizer.params.eps)", o.adam_eps, o.adam_eps >= 0),
            ("--weight-decay (optimizer.params.weight_decay)", o.weight_decay, o.weight_decay >= 0),
            ("--clip-grad (gradient_clipping)", o.clip_grad, o.clip_grad >= 0),
            ("--lr-warmup-iters (scheduler.params.warmup_num_steps)", o.lr_warmup_iters,
             o.lr_warmup_iters >= 0)):
        check(ok, f"{flag}: got {value}, expected a value >= 0 (betas: 0 <= beta < 1)")
    onebit = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
              "onebitlamb": "OneBitLamb"}.get(o.optimizer)
    if onebit:  # DeepSpeed: "1bit-Adam is not compatible with ZeRO", and so 0/1 Adam
        check(cfg.zero.stage == 0, f"optimizer.type {onebit} runs without ZeRO, as "
              f"DeepSpeed's: set zero_optimization.stage 0 (--zero-stage 0), or use Adam, AdamW "
              f"or Lamb at stage {cfg.zero.stage}")
        for name in ("freeze_step", "var_freeze_step", "var_update_scaler",
                     "local_step_scaler", "local_step_clipper"):
            check(getattr(o, name) >= 1, f"optimizer.params.{name}: got {getattr(o, name)}, "
                  "expected >= 1")
    gas = t.gradient_accumulation_steps
    if p.world_size is not None and t.global_batch_size is not None and gas is not None:
        dp = p.dp
        want = t.micro_batch_size * gas * dp
        check(t.global_batch_size == want,
              f"batch sizes do not add up: train_batch_size {t.global_batch_size} != "
              f"train_micro_batch_size_per_gpu {t.micro_batch_size} x "
              f"gradient_accumulation_steps {gas} x dp_size {dp} = {want}; set "
              f"train_batch_size to {want}")
