"""The optimizer-side sections of :class:`megazero.config.MegazeroConfig`: the optimizer and its
learning-rate schedule, mixed precision, and ZeRO with its offload and ``aio`` blocks; the parts
the DeepSpeed JSON's ``optimizer``, ``scheduler``, ``fp16`` / ``bf16``, ``zero_optimization``
and ``aio`` blocks fill (see :mod:`megazero.config.schema` for the rest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from megazero.config.rules import check as _check

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``. With ``device: nvme`` the states live in files
    under ``nvme_path`` and stream through ``buffer_count`` host buffers (checked in
    :func:`megazero.zero.offload.check_offload`). ``buffer_count`` None: DeepSpeed's default
    for the block (4 for the optimizer, 5 for parameters). ``pin_memory``: DeepSpeed's default
    (false) here; a config whose block leaves it unset gets true on a machine with CUDA (the
    config merge), where pinned buffers make the device-host copies asynchronous."""

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
    """DeepSpeed's ``zero_optimization`` block (same key names and defaults), plus Megatron's
    ``--overlap-param-gather``. Runs on NCCL that leave them unset get Megatron's GPU settings
    instead (:func:`nccl_zero_defaults`, applied by the config merge)."""

    stage: Literal[0, 1, 2, 3] = 0
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    # stages 1-2: the parameters' all-gather after the step runs asynchronously per bucket and
    # the first module of the next forward that uses a bucket waits for it
    overlap_param_gather: bool = False
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


def nccl_zero_defaults(dp: int) -> dict[str, Any]:
    """Megatron's settings for GPU runs, for the ``zero`` fields a run on NCCL leaves unset:
    gradient reduction overlapped with backward (``--overlap-grad-reduce``), the parameter
    all-gather with the next forward (``--overlap-param-gather``), and buckets of
    ``max(40M, 1M x dp)`` elements (megatron-core's ``--ddp-bucket-size`` default). On gloo the
    dataclass defaults (DeepSpeed's) stay: on one host stages 0-2 reduce and gather through
    shared memory, whose collectives run inside their wait, so overlap buys nothing there."""
    return {"overlap_comm": True, "overlap_param_gather": True,
            "reduce_bucket_size": max(40_000_000, 1_000_000 * dp)}


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
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None  # None: see grad_dtype
    # DeepSpeed's data_types.grad_accum_dtype; Megatron's --accumulate-allreduce-grads-in-fp32
    # sets "fp32". None: fp32 for bf16 (Megatron's default), the params' dtype otherwise.
    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    # FP8 GEMMs in the transformer layers' linears (megazero.fp8), Megatron's flags; off while
    # fp8_format is None
    fp8_format: Literal["e4m3", "hybrid"] | None = None
    fp8_recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"] = "delayed"
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    fp8_margin: int = 0
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    fp8_param_gather: bool = False

    def __post_init__(self) -> None:
        self._check_fp8()
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
        _check(self.grad_accum_dtype in (None, "fp32", "fp16", "bf16"),
               f"data_types.grad_accum_dtype: got {self.grad_accum_dtype!r}, expected fp32, "
               f"fp16 or bf16")
        _check(None in (self.grad_accum_dtype, self.communication_data_type)
               or self.grad_accum_dtype == self.communication_data_type,
               f"data_types.grad_accum_dtype {self.grad_accum_dtype!r} and "
               f"communication_data_type {self.communication_data_type!r} differ: megazero "
               f"accumulates and reduces gradients in one dtype; set them equal or drop one")

    def _check_fp8(self) -> None:
        _check(self.fp8_format in (None, "e4m3", "hybrid"),
               f"--fp8-format {self.fp8_format}: expected e4m3 or hybrid (e5m2 gradients)")
        _check(self.fp8_recipe in ("tensorwise", "delayed", "blockwise", "mxfp8"),
               f"--fp8-recipe {self.fp8_recipe}: expected tensorwise, delayed, blockwise or mxfp8")
        _check(self.fp8_amax_compute_algo in ("most_recent", "max"),
               f"--fp8-amax-compute-algo {self.fp8_amax_compute_algo}: expected most_recent or "
               "max")
        for flag, v in (("--fp8-amax-history-len", self.fp8_amax_history_len),
                        ("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16)):
            _check(isinstance(v, int) and v >= (1 if "history" in flag else 0),
                   f"{flag} {v}: expected an integer >= {1 if 'history' in flag else 0}")
        _check(isinstance(self.fp8_margin, int) and self.fp8_margin >= 0,
               f"--fp8-margin {self.fp8_margin}: expected an integer >= 0 (binades of headroom)")
        if self.fp8_format is None:
            given = [flag for flag, on in (
                ("--fp8-recipe", self.fp8_recipe != "delayed"),
                ("--fp8-amax-history-len", self.fp8_amax_history_len != 1),
                ("--fp8-amax-compute-algo", self.fp8_amax_compute_algo != "most_recent"),
                ("--fp8-margin", self.fp8_margin != 0),
                ("--first-last-layers-bf16", self.first_last_layers_bf16),
                ("--fp8-param-gather", self.fp8_param_gather)) if on]
            _check(not given, f"{', '.join(given)} without --fp8-format: FP8 is off; add "
                   "--fp8-format hybrid (or e4m3), or drop them")
        elif self.fp8_recipe != "delayed":
            _check(self.fp8_amax_history_len == 1 and self.fp8_amax_compute_algo ==
                   "most_recent" and self.fp8_margin == 0,
                   f"--fp8-amax-history-len, --fp8-amax-compute-algo and --fp8-margin set "
                   f"delayed scaling, and --fp8-recipe is {self.fp8_recipe}; use --fp8-recipe "
                   "delayed or drop them")

    @property
    def grad_dtype_name(self) -> str:
        """The dtype gradients accumulate over micro-batches and are reduced over data-parallel
        ranks in. bf16 defaults to fp32, as Megatron's ``main_grad`` (bf16 sums of many
        micro-batches, and a bf16 reduction over many ranks, lose the small contributions);
        fp16 and fp32 keep the parameters' dtype, as Megatron and DeepSpeed do."""
        name = self.grad_accum_dtype or self.communication_data_type
        if name is not None:
            return name
        return "fp32" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def grad_dtype(self) -> torch.dtype:
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16,
                "bf16": torch.bfloat16}[self.grad_dtype_name]

    @property
    def params_dtype(self) -> torch.dtype:
        import torch

        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32


@dataclass(frozen=True)
class OptimizerConfig:
    # adamw: decoupled weight decay; adam: L2 decay in the gradient; sgd: SGD with momentum;
    # lion: Lion (betas from adam_beta1/2); lamb: DeepSpeed's Lamb (betas, eps from adam_*);
    # onebitadam / zerooneadam / onebitlamb: DeepSpeed's 1-bit optimizers (ZeRO stage 0)
    optimizer: Literal["adamw", "adam", "sgd", "lion", "lamb", "onebitadam", "zerooneadam",
                       "onebitlamb"] = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9  # Megatron's --sgd-momentum default
    sgd_nesterov: bool = False
    sgd_dampening: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # 0 disables clipping
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # default: train_iters
    lr_warmup_fraction: float | None = None  # warm-up = fraction x decay steps (Megatron)
    lr_warmup_samples: int | None = None  # sample-based lengths, turned into iterations
    lr_decay_samples: int | None = None  # by ds_merge once the global batch is known
    # Megatron-DeepSpeed's token-based schedule: warm-up and decay counted in tokens consumed
    lr_warmup_tokens: int | None = None
    lr_decay_tokens: int | None = None
    # Megatron's --decoupled-lr: the input embedding and output layer on their own peak and
    # minimum learning rate (the same schedule shape)
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    scheduler_type: str | None = None  # DeepSpeed scheduler block: WarmupLR, WarmupDecayLR, ...
    scheduler_params: dict[str, Any] = field(default_factory=dict)  # its params, "auto" filled in
    # The DeepSpeed JSON has an "optimizer" block: the engine builds the optimizer from it.
    from_ds_config: bool = False
    # Lamb (DeepSpeed's params.max_coeff / min_coeff / bias_correction): the trust ratio's
    # clamp, and whether the step size carries Adam's bias corrections
    lamb_max_coeff: float = 10.0
    lamb_min_coeff: float = 0.01
    bias_correction: bool = True
    # OneBitAdam (DeepSpeed's params): full-precision steps before the compressed exchange;
    # cuda_aware / comm_backend_name pick DeepSpeed's transport (recorded, the dp group's
    # backend carries it here)
    freeze_step: int = 100000
    cuda_aware: bool = False
    comm_backend_name: str = "nccl"
    # ZeroOneAdam (DeepSpeed's params): the variance-refresh and local-step schedules
    var_freeze_step: int = 100000
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16
    # OneBitLamb (DeepSpeed's params): the frozen ratio's average and the factor's bounds
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1
