"""The run's settings besides the model and the optimizer: parallel layout and recomputation,
data, training, logging and checkpointing sections of
:class:`megazero.config.schema.MegazeroConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megazero.config.rules import check as _check
from megazero.config.rules import (
    check_expert_grid,
    check_vpp_needs_pp,
    check_world_size,
    sequence_parallel_active,
)
from megazero.errors import ConfigError

#: ``--tokenizer-type`` values (Megatron's names); :func:`megazero.data.tokenizers.build_tokenizer`
#: builds each.
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")


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
    # --pipeline-schedule (None: 1f1b, or interleaved with virtual stages) and Megatron's
    # --delay-wgrad-compute (1F1B with each backward's weight gradients after its exchange)
    pipeline_schedule: Literal["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"] | None = None
    delay_wgrad_compute: bool = False
    # Uneven layer splits (Megatron's flags): see megazero.config.rules.stage_layer_counts
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None
    sequence_parallel: bool = False
    # Megatron's --tp-comm-overlap and its per-part switches (megazero.tensor_parallel.overlap):
    # the sequence-parallel all-gathers / reduce-scatters inside the linear layers' GEMMs
    tp_comm_overlap: bool = False
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_bulk_dgrad: bool = True
    tp_comm_bulk_wgrad: bool = True
    # Megatron's --overlap-moe-expert-parallel-comm (megazero.combined_1f1b): the forward of
    # one micro-batch and the backward of another take turns at their MoE all-to-alls
    overlap_moe_expert_parallel_comm: bool = False
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
        _check(not self.tp_comm_overlap or self.sequence_parallel_active,
               "--tp-comm-overlap hides the sequence-parallel all-gathers and reduce-scatters "
               f"in the GEMMs, and --tensor-model-parallel-size {self.tp} "
               f"{'with' if self.sequence_parallel else 'without'} --sequence-parallel has "
               "none: add --sequence-parallel (with --tensor-model-parallel-size > 1) or drop "
               "--tp-comm-overlap")

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
    def uneven_split(self) -> bool:
        """Any of Megatron's uneven pipeline-split flags is given."""
        return (self.decoder_first_pipeline_num_layers is not None
                or self.decoder_last_pipeline_num_layers is not None
                or self.account_for_embedding_in_pipeline_split
                or self.account_for_loss_in_pipeline_split
                or self.pipeline_model_parallel_layout is not None)

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
    # packed documents kept apart (megazero.model.packed): positions restart after each
    # end-of-document token, and attention stays inside each document
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # Megatron's --train/valid/test-data-path: each split its own corpus ("[W] PREFIX ...")
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()
    mmap_bin_files: bool = True  # --no-mmap-bin-files: read each .bin into memory
    tiktoken_pattern: Literal["v1", "v2"] | None = None  # TikTokenizer's regex (None: v2)
    tiktoken_num_special_tokens: int = 1000  # ids below the vocabulary (Megatron's default)

    @property
    def per_split_paths(self) -> bool:
        """The splits come from their own corpora (--train-data-path ...), not --split."""
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None  # derived from the batch triad
    # neither --global-batch-size nor train_batch_size was given: the global batch is
    # micro x accumulation x dp, and a resume at another dp keeps the checkpoint's instead
    global_batch_derived: bool = False
    train_iters: int | None = None
    train_samples: int | None = None
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    # bitwise-reproducible GPU runs (see megazero.distributed.startup)
    deterministic_mode: bool = False
    # Skip a step whose loss or gradients are NaN/inf (fp32/bf16 too, as fp16's overflow skip);
    # stop the run after this many such steps in a row (the weights themselves are then bad).
    check_for_nan_in_loss_and_grad: bool = True
    max_nonfinite_steps: int = 3
    spike_factor: float = 10.0  # a step this many times the recent median is a spike; 0: off
    spike_window: int = 50  # sound steps the median is taken over
    max_spike_steps: int = 10  # spiked steps in a row (finite loss) before the run stops
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START
    # by INCREMENT over the first SAMPLES samples (in equal steps), then stays at its full size.
    rampup_batch_size: tuple[int, int, int] | None = None
    manual_gc: bool = False  # Python's automatic GC off; collected every manual_gc_interval
    manual_gc_interval: int = 0  # iterations between collections (0: none during training)
    manual_gc_eval: bool = True  # also collect around evaluation
    # Megatron-DeepSpeed's --train-tokens: stop once this many tokens are consumed
    train_tokens: int | None = None
    # Megatron's --calculate-per-token-loss: the loss is the sum over the global batch's tokens
    # divided by their count (not a mean of per-micro-batch means)
    calculate_per_token_loss: bool = False
    empty_unused_memory_level: int = 0  # Megatron's: 1 empty the CUDA cache per iteration, 2 +eval


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_job_name: str | None = None
    wall_clock_breakdown: bool = False
    log_memory_phases: bool = False  # memory after forward / backward / step, per logged iteration
    # --log-straggler: each rank's busy time per log interval (megazero.observability.stragglers)
    log_straggler: bool = False
    # --log-fp8-amax: FP8 operands whose amax the log line and TensorBoard carry, as fnmatch
    # patterns over "<module>.<x|w|dy>" (decoder.layers.1.mlp.linear_fc1.x)
    log_fp8_amax: tuple[str, ...] = ()
    straggler_minmax_count: int = 1  # slowest and fastest ranks listed
    straggler_factor: float = 3.0  # busy time over this many times the median is slow
    straggler_patience: int = 3  # log intervals in a row before a rank is named in a warning
    steps_per_print: int = 10  # DeepSpeed's own progress print; --log-interval drives the log line
    wandb: dict[str, Any] = field(default_factory=dict)
    csv_monitor: dict[str, Any] = field(default_factory=dict)
    # the comms_logger and flops_profiler blocks (megazero.config.observability_schema)
    comms_logger: dict[str, Any] = field(default_factory=dict)
    flops_profiler: dict[str, Any] = field(default_factory=dict)
    log_json: str | None = None  # also append each logged iteration's metrics here (JSON lines)
    log_num_zeros_in_grad: bool = False  # Megatron: count the gradient's zeros, logged each line
    # Megatron's --profile: iterations [profile_step_start, profile_step_end) on profile_ranks,
    # through torch.profiler with --use-pytorch-profiler, else a cudaProfilerStart/Stop range
    # (nsys --capture-range=cudaProfilerApi); see megazero/observability/profiling.py
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)
    # Megatron's TensorBoard switches
    tensorboard_queue_size: int = 1000  # events held before a write (SummaryWriter max_queue)
    log_timers_to_tensorboard: bool = False  # the regions' times, without the printed line
    log_batch_size_to_tensorboard: bool = False  # + "batch-size vs samples"
    log_optimizer_states_to_tensorboard: bool = False  # norms of the Adam moments and weights
    log_validation_ppl_to_tensorboard: bool = False  # + "lm loss validation ppl vs samples"
    # Megatron's wandb flags (the JSON's "wandb" block says the same)
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None

    @property
    def timed(self) -> bool:
        """Whether the iterations' regions are timed: to print them or to write them."""
        return self.wall_clock_breakdown or self.log_timers_to_tensorboard

    @property
    def wandb_block(self) -> dict[str, Any]:
        """The JSON's ``wandb`` block with Megatron's ``--wandb-*`` flags folded in (a project
        turns it on, as in Megatron)."""
        block = dict(self.wandb)
        if self.wandb_project:
            block.update(enabled=True, project=self.wandb_project)
        if self.wandb_exp_name:
            block["job_name"] = self.wandb_exp_name
        if self.wandb_save_dir:
            block["output_path"] = self.wandb_save_dir
        return block


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
    async_save: bool = False  # write checkpoints in the background (megazero.checkpoint.async_save)
    exit_on_save_failure: bool = False  # a failed asynchronous save stops the run
