"""Typed, frozen configuration: one :class:`MegazeroConfig` per run, validated in one place.

The dataclasses below are the single source of truth for every setting. They are filled from
Megatron-style command-line flags and an optional DeepSpeed-style JSON config by
:func:`megazero.config.load_config`; components receive the sub-config they need. The
optimizer, precision and ZeRO sections live in :mod:`megazero.config.optim_schema`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from megazero.config.moe_schema import MoEConfig
from megazero.config.optim_schema import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.rules import check as _check
from megazero.config.rules import (
    check_expert_grid,
    check_vpp_needs_pp,
    check_world_size,
    sequence_parallel_active,
    validate,
)
from megazero.errors import ConfigError

if TYPE_CHECKING:
    from megazero.topology import ParallelLayout


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
    rotary_percent: float = 1.0  # the share of each head's dims RoPE rotates (GPT-NeoX, Megatron)
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's "gelu_new"), Megatron's flag
    add_bias_linear: bool = True
    # a bias on the fused QKV linear whatever add_bias_linear says (Megatron's --add-qkv-bias;
    # Qwen2's attention): read it through ``qkv_bias``
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    kv_channels: int | None = None  # Megatron's per-head width; default hidden / heads
    use_flash_attn: bool = True  # used only when flash-attn is installed and tensors are on GPU
    group_query_attention: bool = False  # Megatron's switch; the group count is num_query_groups
    model_preset: Literal["gpt2", "llama"] | None = None  # the preset the fields started from
    # Megatron's elementwise fusions (megazero.fusions, through torch.compile), on by default
    # as in Megatron; they run on CUDA, and on CPU only with fusions_on_cpu (for tests)
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    fusions_on_cpu: bool = False
    moe: MoEConfig = field(default_factory=MoEConfig)  # Mixture of Experts; dense when unset
    # Megatron's --qk-layernorm (Qwen3): --normalization over each head's queries and keys
    # (one head_dim weight each, shared by the heads) after the QKV projection, before RoPE
    qk_layernorm: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # a config read back from JSON (checkpoint, converter)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"--{name.replace('_', '-')} must be a positive "
                   f"integer, got {v!r}")
        _check(self.kv_channels is not None
               or self.hidden_size % self.num_attention_heads == 0,
               f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
               f"{self.num_attention_heads}; pick a hidden size that is a multiple of the heads "
               "or set the head width with --kv-channels")
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
        _check(self.kv_channels is None
               or (isinstance(self.kv_channels, int) and self.kv_channels > 0),
               f"--kv-channels must be a positive integer, got {self.kv_channels!r}")
        rot = self.head_dim * self.rotary_percent
        _check(0 < self.rotary_percent <= 1 and rot == int(rot) and int(rot) % 2 == 0,
               f"--rotary-percent {self.rotary_percent}: expected 0 < p <= 1 with head dim "
               f"{self.head_dim} x p an even integer (e.g. 0.25, 0.5, 1.0)")
        _check(self.max_positions >= self.seq_length,
               f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
               f"--seq-length {self.seq_length}")

    @property
    def head_dim(self) -> int:
        """Each head's width: ``--kv-channels`` (Megatron's name; Qwen3's ``head_dim``, which
        may differ from hidden / heads), by default hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates; the rest pass through."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV linear has a bias: every linear has one, or only QKV
        (``--disable-bias-linear --add-qkv-bias``, Qwen2). The one place the rule lives."""
        return self.add_bias_linear or self.add_qkv_bias

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


#: What selective recomputation can rematerialise (Megatron's ``--recompute-modules`` names).
RECOMPUTE_MODULES = ("core_attn",)


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation, Megatron's ``--recompute-granularity``, ``--recompute-method``
    and ``--recompute-num-layers`` (see :func:`megazero.model.recompute.apply_recompute`).

    ``granularity`` None: nothing recomputed. ``"full"``: whole layers rerun in backward,
    ``method`` says which (``uniform``: groups of ``num_layers`` consecutive layers, each
    keeping one input; ``block``: the first ``num_layers`` layers of each chunk, one by one).
    ``"selective"``: only ``modules`` rerun; ``method`` and ``num_layers`` are then unused.

    What a ``full`` group keeps, its input: ``distribute_saved_activations`` (Megatron's flag,
    DeepSpeed's ``activation_checkpointing.partition_activations``) keeps 1/tp of it on each
    tensor-parallel rank and all-gathers it for the recomputation; ``cpu_checkpointing``
    (DeepSpeed's) keeps it in host memory. See :mod:`megazero.tensor_parallel.saved_inputs`.
    """

    granularity: Literal["full", "selective"] | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int = 1
    modules: tuple[str, ...] = ("core_attn",)
    distribute_saved_activations: bool = False
    cpu_checkpointing: bool = False

    def __post_init__(self) -> None:
        _check(self.granularity in (None, "full", "selective"),
               f"--recompute-granularity {self.granularity!r}: expected full or selective")
        _check(self.method in (None, "uniform", "block"),
               f"--recompute-method {self.method!r}: expected uniform or block")
        if self.granularity == "full":
            _check(self.method is not None,
                   "--recompute-granularity full needs --recompute-method uniform or block")
        _check(self.num_layers >= 1, f"--recompute-num-layers must be >= 1, got {self.num_layers}")
        unknown = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        _check(bool(self.modules) and not unknown,
               f"recompute modules {self.modules!r}: selective recomputation supports "
               f"{RECOMPUTE_MODULES}; list one or more of those")


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
    distribute_saved_activations: bool = False  # full recompute: 1/tp of each group's input
    cpu_checkpointing: bool = False  # full recompute: each group's input in host memory
    distributed_backend: Literal["nccl", "gloo"] | None = None  # None: nccl on GPU, gloo on CPU
    # Every process group's collective timeout; also the watchdog's limit for one iteration.
    distributed_timeout_minutes: float = 10.0
    world_size: int | None = None  # all ranks; None when the config is built without a launcher
    # Context parallelism: the sequence split over this many ranks, and how attention crosses
    # the split (p2p ring, all_gather, a2a Ulysses); megatron-core's flags.
    context_parallel_size: int = 1
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    # MoE layers' expert grid (etp x ep x edp x pp over the same ranks, megatron-core's order)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1  # Megatron's default is --tensor-model-parallel-size

    def __post_init__(self) -> None:
        _check(self.tensor_model_parallel_size >= 1 and self.pipeline_model_parallel_size >= 1,
               "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        _check(self.context_parallel_size >= 1,
               f"--context-parallel-size must be >= 1, got {self.context_parallel_size}")
        if self.world_size is not None:
            check_world_size(self.world_size, self.tp, self.pp, cp=self.cp)
        _check(self.expert_model_parallel_size >= 1, "--expert-model-parallel-size must be "
               f">= 1, got {self.expert_model_parallel_size}")
        _check(self.expert_tensor_parallel_size >= 1, "--expert-tensor-parallel-size must be "
               f">= 1, got {self.expert_tensor_parallel_size}")
        if self.world_size is not None:
            check_expert_grid(self.world_size, self.expert_model_parallel_size,
                              self.expert_tensor_parallel_size, self.pp)
        if self.num_layers_per_virtual_pipeline_stage is not None:
            _check(self.num_layers_per_virtual_pipeline_stage >= 1, "--num-layers-per-virtual-"
                   f"pipeline-stage must be >= 1, got {self.num_layers_per_virtual_pipeline_stage}")
            check_vpp_needs_pp(self.pp, self.num_layers_per_virtual_pipeline_stage,
                               "--num-layers-per-virtual-pipeline-stage (interleaved schedule)")
        _ = self.recompute  # the --recompute-* flags are checked by RecomputeConfig

    @property
    def recompute(self) -> RecomputeConfig:
        """The three ``--recompute-*`` flags as the one value the model and planner take."""
        return RecomputeConfig(
            self.recompute_granularity, self.recompute_method,
            1 if self.recompute_num_layers is None else self.recompute_num_layers,
            distribute_saved_activations=self.distribute_saved_activations,
            cpu_checkpointing=self.cpu_checkpointing)

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def sequence_parallel_active(self) -> bool:
        """--sequence-parallel and tp > 1 (it is a mode of the TP group)."""
        return sequence_parallel_active(self.sequence_parallel, self.tp)

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (tp * cp * pp); TP, CP and PP ranks are not
        replicas (CP ranks share each sample, split along the sequence)."""
        if self.world_size is None:
            raise ConfigError("the data-parallel size needs the world size; build the config "
                              "with load_config(argv, world_size)")
        return check_world_size(self.world_size, self.tp, self.pp, cp=self.cp)


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
    eod_mask_loss: bool = False  # Megatron: no loss on the token that follows an end-of-document


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
    spike_factor: float = 10.0  # a step this many times the recent median is a spike; 0: off
    spike_window: int = 50  # sound steps the median is taken over
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START
    # by INCREMENT over the first SAMPLES samples (in equal steps), then stays at its full size.
    rampup_batch_size: tuple[int, int, int] | None = None
    manual_gc: bool = False  # Python's automatic GC off; collected every manual_gc_interval
    manual_gc_interval: int = 0  # iterations between collections (0: none during training)
    manual_gc_eval: bool = True  # also collect around evaluation


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_job_name: str | None = None
    wall_clock_breakdown: bool = False
    log_memory_phases: bool = False  # memory after forward / backward / step, per logged iteration
    steps_per_print: int = 10  # DeepSpeed's own progress print; --log-interval drives the log line
    wandb: dict[str, Any] = field(default_factory=dict)
    csv_monitor: dict[str, Any] = field(default_factory=dict)
    comms_logger: dict[str, Any] = field(default_factory=dict)  # megazero/comms_logging.py
    flops_profiler: dict[str, Any] = field(default_factory=dict)  # megazero/flops_profiler.py
    log_json: str | None = None  # also append each logged iteration's metrics here (JSON lines)
    log_num_zeros_in_grad: bool = False  # Megatron: count the gradient's zeros, logged each line
    # Megatron's --profile: iterations [profile_step_start, profile_step_end) on profile_ranks,
    # through torch.profiler with --use-pytorch-profiler, else a cudaProfilerStart/Stop range
    # (nsys --capture-range=cudaProfilerApi); see megazero/profiling.py
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)


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
    overwrite_checkpoints: bool = False  # --save may hold another run's newer checkpoints


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
        per_chunk = self.parallel.num_layers_per_virtual_pipeline_stage
        return None if per_chunk is None else self.model.num_layers // self.parallel.pp // per_chunk

    def layout(self) -> ParallelLayout:
        """The :class:`~megazero.topology.ParallelLayout` of this run (needs the world size)."""
        from megazero.topology import ParallelLayout

        if self.parallel.world_size is None:
            raise ConfigError("the layout needs the world size; build the config with "
                              "load_config(argv, world_size)")
        return ParallelLayout(self.parallel.world_size, self.parallel.tp, self.parallel.pp,
                              self.vpp, self.parallel.cp,
                              ep=self.parallel.expert_model_parallel_size,
                              etp=self.parallel.expert_tensor_parallel_size)


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
