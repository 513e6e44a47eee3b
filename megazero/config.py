"""Typed, frozen configuration: one :class:`MegazeroConfig` per run, validated in one place.

The dataclasses below are the single source of truth for every setting. They are filled from
Megatron-style command-line flags and an optional DeepSpeed-style JSON config by
:func:`megazero.arguments.load_config`; components receive the sub-config they need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megazero.errors import MegazeroError


class ConfigError(MegazeroError, ValueError):
    """A setting that is wrong; the message names the key, what was given and the fix."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4h; with swiglu Megatron's 8h/3 rounded to 64
    num_query_groups: int | None = None  # grouped-query attention; None = one group per head
    seq_length: int = 64
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 1024  # tokenizer's vocabulary; padded by the embedding layer
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    rotary_base: float = 10000.0
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's "gelu_new"), Megatron's flag
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    kv_channels: int | None = None  # Megatron's per-head width; must be hidden / heads here
    use_flash_attn: bool = True  # used only when flash-attn is installed and tensors are on GPU
    group_query_attention: bool = False  # Megatron's switch; the group count is num_query_groups
    model_preset: str | None = None  # "gpt2" / "llama": the preset the fields were started from

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"--{name.replace('_', '-')} must be a positive "
                   f"integer, got {v!r}")
        _check(self.hidden_size % self.num_attention_heads == 0,
               f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
               f"{self.num_attention_heads}; pick a hidden size that is a multiple of the heads")
        if self.num_query_groups is not None:
            _check(self.num_query_groups > 0
                   and self.num_attention_heads % self.num_query_groups == 0,
                   f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                   f"--num-query-groups {self.num_query_groups}")
        _check(self.position_embedding_type in ("learned_absolute", "rope"),
               f"--position-embedding-type {self.position_embedding_type!r}: expected "
               f"learned_absolute or rope")
        _check(self.normalization in ("LayerNorm", "RMSNorm"),
               f"--normalization {self.normalization!r}: expected LayerNorm or RMSNorm")
        _check(not self.group_query_attention or self.num_query_groups is not None,
               "--group-query-attention needs --num-query-groups N (the number of key/value "
               "heads)")
        _check(self.kv_channels in (None, self.head_dim),
               f"--kv-channels {self.kv_channels}: megazero's head width is --hidden-size / "
               f"--num-attention-heads = {self.head_dim}; drop --kv-channels or make them agree")
        _check(self.max_positions >= self.seq_length,
               f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
               f"--seq-length {self.seq_length}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return max(64, int(4 * self.hidden_size * 2 / 3) // 64 * 64)
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """``gpt2``: learned positions, LayerNorm, GELU, biases, tied embeddings.
        ``llama``: RoPE, RMSNorm, SwiGLU, no biases, untied embeddings, grouped-query attention.
        """
        presets = {
            "gpt2": dict(),
            "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                          add_bias_linear=False, untie_embeddings_and_output_weights=True),
        }
        _check(name in presets, f"unknown model preset {name!r}; expected one of {list(presets)}")
        return cls(**{**presets[name], **overrides})


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    # Interleaved schedule: micro-batches pass each model chunk in groups of this many
    # (Megatron's --microbatch-group-size-per-virtual-pipeline-stage); None means pp.
    microbatch_group_size_per_vp_stage: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    distributed_backend: str | None = None  # None: nccl on GPU, gloo on CPU
    # Every process group's collective timeout; also the watchdog's limit for one iteration.
    distributed_timeout_minutes: float = 10.0
    world_size: int | None = None  # all ranks; None when the config is built without a launcher

    def __post_init__(self) -> None:
        _check(self.tensor_model_parallel_size >= 1 and self.pipeline_model_parallel_size >= 1,
               "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        if self.world_size is not None:
            mp = self.tp * self.pp
            _check(self.world_size >= 1 and self.world_size % mp == 0,
                   f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                   f"{self.tp} x --pipeline-model-parallel-size {self.pp} = {mp}; launch a "
                   f"multiple of {mp} processes or choose TP/PP sizes whose product divides "
                   f"{self.world_size}")
        if self.num_layers_per_virtual_pipeline_stage is not None:
            _check(self.num_layers_per_virtual_pipeline_stage >= 1, "--num-layers-per-virtual-"
                   f"pipeline-stage must be >= 1, got {self.num_layers_per_virtual_pipeline_stage}")
            _check(self.pp > 1,
                   "--num-layers-per-virtual-pipeline-stage (interleaved schedule) needs "
                   "--pipeline-model-parallel-size > 1; drop it or use more pipeline stages")
        _check(self.recompute_granularity in (None, "full", "selective"),
               f"--recompute-granularity {self.recompute_granularity!r}: expected full or "
               f"selective")
        _check(self.recompute_method in (None, "uniform", "block"),
               f"--recompute-method {self.recompute_method!r}: expected uniform or block")
        if self.recompute_granularity == "full":
            _check(self.recompute_method is not None,
                   "--recompute-granularity full needs --recompute-method uniform or block")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (tp * pp); TP and PP ranks are not replicas."""
        _check(self.world_size is not None, "the data-parallel size needs the world size; build "
               "the config with load_config(argv, world_size)")
        return self.world_size // (self.tp * self.pp)


@dataclass(frozen=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``. With ``device: nvme`` the states live in files
    under ``nvme_path`` and stream through ``buffer_count`` host buffers (checked in
    :func:`megazero.zero.offload.check_offload`). ``buffer_count`` None: DeepSpeed's default
    for the block (4 for the optimizer, 5 for parameters)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: bool = False
    nvme_path: str | None = None
    buffer_count: int | None = None
    buffer_size: int = 100_000_000  # offload_param: elements per buffer
    max_in_cpu: int = 1_000_000_000  # offload_param: elements kept in host memory, not on disk
    pipeline_read: bool = False
    pipeline_write: bool = False

    @property
    def enabled(self) -> bool:
        """Offloaded at all (the optimizer step runs on the host for both devices)."""
        return self.device in ("cpu", "nvme")

    @property
    def nvme(self) -> bool:
        return self.device == "nvme"


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's top-level ``aio`` block: how swap files are read and written.
    ``intra_op_parallelism`` x ``queue_depth`` requests of ``block_size`` bytes are in flight at
    once (``thread_count`` is the older name of ``intra_op_parallelism``)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` block (same key names and defaults)."""

    stage: int = 0
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    sub_group_size: int = 1_000_000_000
    round_robin_gradients: bool = False
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    aio: AioConfig = field(default_factory=AioConfig)  # the JSON's top-level "aio" block

    def __post_init__(self) -> None:
        _check(self.stage in (0, 1, 2, 3),
               f"zero_optimization.stage: got {self.stage!r}, expected one of 0, 1, 2, 3")
        for name in ("allgather_bucket_size", "reduce_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "sub_group_size"):
            _check(getattr(self, name) >= 0, f"zero_optimization.{name}: got "
                   f"{getattr(self, name)}, expected an integer >= 0")


@dataclass(frozen=True)
class PrecisionConfig:
    """``fp16`` / ``bf16`` blocks. fp32 master weights are kept in both mixed modes."""

    fp16: bool = False
    bf16: bool = False
    loss_scale: float = 0.0  # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    communication_data_type: str | None = None  # None: the parameters' dtype

    def __post_init__(self) -> None:
        _check(not (self.fp16 and self.bf16),
               "fp16.enabled and bf16.enabled are both true; enable at most one of them")
        _check(self.loss_scale >= 0, f"fp16.loss_scale (--loss-scale): got {self.loss_scale}, "
               f"expected 0 (dynamic) or a positive static scale")
        _check(self.hysteresis >= 1 and self.loss_scale_window >= 1,
               f"fp16.hysteresis ({self.hysteresis}) and fp16.loss_scale_window "
               f"({self.loss_scale_window}) must be >= 1")
        _check(self.communication_data_type in (None, "fp32", "fp16", "bf16"),
               f"communication_data_type: got {self.communication_data_type!r}, expected fp32, "
               f"fp16 or bf16")

    @property
    def params_dtype(self):
        import torch

        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: Literal["adamw", "adam"] = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # 0 disables clipping
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # default: train_iters
    lr_warmup_fraction: float | None = None  # warm-up = fraction x decay steps (Megatron)
    lr_warmup_samples: int | None = None  # sample-based lengths, turned into iterations
    lr_decay_samples: int | None = None  # by ds_merge once the global batch is known
    scheduler_type: str | None = None  # DeepSpeed scheduler block: WarmupLR, WarmupDecayLR, ...
    scheduler_params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] = ()  # "A" or "0.3 A 0.7 B" split into tokens
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    data_cache_path: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None  # derived from the batch triad
    train_iters: int | None = None
    train_samples: int | None = None
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    deterministic_mode: bool = False  # bitwise-reproducible GPU runs (see dist_init.py)
    # Skip a step whose loss or gradients are NaN/inf (fp32/bf16 too, as fp16's overflow skip);
    # stop the run after this many such steps in a row (the weights themselves are then bad).
    check_for_nan_in_loss_and_grad: bool = True
    max_nonfinite_steps: int = 3


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_job_name: str | None = None
    wall_clock_breakdown: bool = False
    log_memory_phases: bool = False  # memory after forward / backward / step, per logged iteration
    steps_per_print: int = 10  # DeepSpeed's own progress print; --log-interval drives the log line
    wandb: dict = field(default_factory=dict)
    csv_monitor: dict = field(default_factory=dict)
    log_json: str | None = None  # also append each logged iteration's metrics here (JSON lines)


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    override_opt_param_scheduler: bool = False  # on resume: the schedule flags given now win
    use_checkpoint_opt_param_scheduler: bool = False  # on resume: the checkpoint's schedule wins
    use_checkpoint_args: bool = False  # take the model's shape from the --load checkpoint


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
    ds_config: dict = field(default_factory=dict)  # that JSON, checked, with "auto" filled in

    def __post_init__(self) -> None:
        validate(self)

    @property
    def vpp(self) -> int | None:
        """Virtual pipeline chunks per stage (interleaved 1F1B), or None without interleaving."""
        per_chunk = self.parallel.num_layers_per_virtual_pipeline_stage
        return None if per_chunk is None else self.model.num_layers // self.parallel.pp // per_chunk

    def layout(self):
        """The :class:`~megazero.topology.ParallelLayout` of this run (needs the world size)."""
        from megazero.topology import ParallelLayout

        _check(self.parallel.world_size is not None, "the layout needs the world size; build the "
               "config with load_config(argv, world_size)")
        return ParallelLayout(self.parallel.world_size, self.parallel.tp, self.parallel.pp,
                              self.vpp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel_split(m: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Can this model be split over ``tp`` ranks? One rule for the CLI config and for a model
    built directly from a :class:`ModelConfig`; every message names the numbers and the fix."""
    _check(m.num_attention_heads % tp == 0,
           f"--num-attention-heads {m.num_attention_heads} is not divisible by "
           f"--tensor-model-parallel-size {tp}; use a TP size that divides the heads "
           f"({_divisors(m.num_attention_heads)}) or a multiple of {tp} heads")
    _check(m.query_groups % tp == 0,
           f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size "
           f"{tp}; each TP rank needs whole key/value groups: use a TP size in "
           f"{_divisors(m.query_groups)} or a multiple of {tp} groups")
    _check(m.ffn_size % tp == 0,
           f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size "
           f"{tp}; use a multiple of {tp}")
    if sequence_parallel and tp > 1:
        _check(m.seq_length % tp == 0,
               f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size "
               f"{tp}, which --sequence-parallel needs (the sequence is split across TP ranks); "
               f"use a multiple of {tp}")


_GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def valid_microbatch_group_sizes(pp: int, num_microbatches: int) -> list[int]:
    """Group sizes N the interleaved schedule accepts for M micro-batches on pp stages:
    ``pp <= N <= M`` and a last group (``M mod N``) that is empty or at least pp."""
    m = num_microbatches
    return [n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp]


def check_microbatch_groups(pp: int, num_microbatches: int | None, group_size: int | None,
                            samples_per_microbatch: int | None = None) -> int:
    """The one rule for the interleaved schedule's micro-batch groups; returns the group size N
    (``group_size``, or pp when None). ``num_microbatches=None`` checks only what N alone can;
    ``samples_per_microbatch`` (micro-batch size x data-parallel size), when known, lets the
    messages name global batch sizes that work.

    Micro-batches go through each model chunk N at a time (Megatron's
    ``--microbatch-group-size-per-virtual-pipeline-stage``). N < pp leaves the ring of virtual
    stages short of work; a last group of 1..pp-1 micro-batches would need the first stage to
    receive an activation before the last stage has produced it.
    """
    n = pp if group_size is None else group_size
    where = f"{_GROUP_FLAG} {n}" if group_size is not None else f"the default group size pp={pp}"
    _check(isinstance(n, int) and n >= pp,
           f"{_GROUP_FLAG} {n} is smaller than --pipeline-model-parallel-size {pp}: each model "
           f"chunk must see at least pp={pp} micro-batches in a row; use a value >= {pp} "
           f"(or leave it out: the default is pp)")
    if num_microbatches is None:
        return n
    m = num_microbatches
    per = samples_per_microbatch
    gbs = f"--global-batch-size {m * per}" if per else "--global-batch-size"
    count = (f"{m} (--global-batch-size / (--micro-batch-size x data-parallel size)"
             f"{f' = {m * per} / {per}' if per else ''})")
    _check(m >= pp,
           f"the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage) needs "
           f"at least --pipeline-model-parallel-size {pp} micro-batches per iteration, got "
           f"{count}; raise --global-batch-size to "
           f"{pp * per if per else f'{pp} micro-batches'} or more, or drop "
           f"--num-layers-per-virtual-pipeline-stage to use 1F1B")
    valid = ", ".join(map(str, valid_microbatch_group_sizes(pp, m)))
    _check(n <= m,
           f"{_GROUP_FLAG} {n} is larger than the {count} micro-batches per iteration; use a "
           f"value from {pp} to {m} whose last group is empty or >= {pp}: {valid}")
    last = m % n
    fits = (f"{gbs} rounded to a multiple of {n * per} (e.g. {m // n * n * per} or "
            f"{(m // n + 1) * n * per})" if per else
            f"a number of micro-batches that is a multiple of {n}")
    _check(last == 0 or last >= pp,
           f"{count} micro-batches in groups of {n} ({where}) leave a last group of {last}, "
           f"but the interleaved pipeline schedule needs the last group to be empty or at "
           f"least --pipeline-model-parallel-size {pp}; set {_GROUP_FLAG} to one of {valid}, "
           f"or use {fits}")
    return n


def validate(cfg: MegazeroConfig) -> None:
    """Checks that involve more than one sub-config; each message names the numbers and the fix."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp = p.tp, p.pp
    check_tensor_parallel_split(m, tp, p.sequence_parallel)
    _check(m.num_layers % pp == 0,
           f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
           f"{pp}; use a multiple of {pp} layers or a PP size in {_divisors(m.num_layers)}")
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        _check(m.num_layers % (pp * per_chunk) == 0,
               f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
               f"{pp} x --num-layers-per-virtual-pipeline-stage {per_chunk} = {pp * per_chunk}; "
               f"use a multiple of {pp * per_chunk} layers or layers-per-virtual-stage in "
               f"{_divisors(m.num_layers // pp) if m.num_layers % pp == 0 else []}")
        num_microbatches = step = None
        if p.world_size is not None and t.global_batch_size is not None:
            step = t.micro_batch_size * p.dp
            if step > 0 and t.global_batch_size % step == 0:
                num_microbatches = t.global_batch_size // step
        check_microbatch_groups(pp, num_microbatches, p.microbatch_group_size_per_vp_stage, step)
    _check(p.recompute_num_layers is None or p.recompute_num_layers >= 1,
           f"--recompute-num-layers must be >= 1, got {p.recompute_num_layers}")
    _check(t.max_nonfinite_steps >= 1, f"--max-nonfinite-steps must be >= 1 (non-finite "
           f"steps in a row before the run stops), got {t.max_nonfinite_steps}")
    _check(p.distributed_timeout_minutes > 0, f"--distributed-timeout-minutes must be > 0, got "
           f"{p.distributed_timeout_minutes}")
    _check(t.micro_batch_size >= 1, f"--micro-batch-size (train_micro_batch_size_per_gpu) must "
           f"be >= 1, got {t.micro_batch_size}")
    _check(t.train_iters is None or t.train_samples is None,
           f"--train-iters {t.train_iters} and --train-samples {t.train_samples} are both given; "
           f"give only one of them")
    o = cfg.optimizer
    for flag, value, ok in (
            ("--lr (optimizer.params.lr)", o.lr, o.lr >= 0),
            ("--min-lr", o.min_lr, o.min_lr >= 0),
            ("--adam-beta1 (optimizer.params.betas[0])", o.adam_beta1, 0 <= o.adam_beta1 < 1),
            ("--adam-beta2 (optimizer.params.betas[1])", o.adam_beta2, 0 <= o.adam_beta2 < 1),
            ("--adam-eps (optimizer.params.eps)", o.adam_eps, o.adam_eps >= 0),
            ("--weight-decay (optimizer.params.weight_decay)", o.weight_decay, o.weight_decay >= 0),
            ("--clip-grad (gradient_clipping)", o.clip_grad, o.clip_grad >= 0),
            ("--lr-warmup-iters (scheduler.params.warmup_num_steps)", o.lr_warmup_iters,
             o.lr_warmup_iters >= 0)):
        _check(ok, f"{flag}: got {value}, expected a value >= 0 (betas: 0 <= beta < 1)")
    if p.world_size is not None and None not in (t.global_batch_size,
                                                 t.gradient_accumulation_steps):
        dp = p.dp
        want = t.micro_batch_size * t.gradient_accumulation_steps * dp
        _check(t.global_batch_size == want,
               f"batch sizes do not add up: train_batch_size {t.global_batch_size} != "
               f"train_micro_batch_size_per_gpu {t.micro_batch_size} x "
               f"gradient_accumulation_steps {t.gradient_accumulation_steps} x dp_size {dp} "
               f"= {want}; set train_batch_size to {want}")
