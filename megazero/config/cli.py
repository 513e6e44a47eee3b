"""The Megatron-style command line: the flag table and its argparse parser.

Every flag in :data:`FLAGS` fills one :class:`~megazero.config.MegazeroConfig` field; every JSON
key is described in :data:`megazero.config.deepspeed.DS_CONFIG_KEYS`. A flag given on the command
line and a JSON value for the same field must agree; ``"auto"`` in the JSON takes the flag's value
(or the default). Parsing a command line is :mod:`megazero.config.parse`, the merge with the JSON
:mod:`megazero.config.merge`; the entry point is :func:`megazero.config.load_config`.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import MISSING, fields
from typing import Any

from megazero.config.flag_help import GROUP_OF_FLAG, GROUP_OF_SECTION, GROUPS, HELP
from megazero.config.flag_types import FLOAT as _FL
from megazero.config.flag_types import INT as _I
from megazero.config.flag_types import ON as _ON
from megazero.config.flag_types import Flag
from megazero.config.flag_types import flag as _f
from megazero.config.schema import MegazeroConfig, field_choices
from megazero.config.script_flags import (
    SCRIPT_FLAG_GROUPS,
    SCRIPT_FLAGS,
    normalization_name,
    pipeline_schedule_name,
    split_proportions,
)
from megazero.config.sections import TOKENIZER_TYPES
from megazero.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting: a bad value is an ``ArgumentError`` naming its
    flag (:func:`megazero.config.parse.parse_args_collecting` notes it and parses on),
    anything else a ConfigError."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"command line: {message}")


def _initial_loss_scale_power(value: float) -> int:
    """Megatron's --initial-loss-scale is a scale; DeepSpeed stores its power of two."""
    power = math.log2(value) if value > 0 else -1.0
    if not power.is_integer() or power < 0:
        raise ConfigError(f"--initial-loss-scale {value}: expected a power of two such as 65536 "
                          f"(2**16) or 4294967296 (2**32); it sets fp16.initial_scale_power")
    return int(power)


def _megatron_optimizer(value: str) -> str:
    """Megatron's ``--optimizer adam`` is Adam with decoupled weight decay (AdamW)."""
    return "adamw" if value == "adam" else value


def _layer_freq(value: str) -> int | tuple[int, ...]:
    """Megatron's ``--moe-layer-freq``: an int N, or a list of 0/1 per layer written as a
    Python expression of lists, ``+`` and ``*`` (``"([1]*3+[0])*2"``), evaluated without eval."""
    import ast

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List | ast.Tuple):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(node)

    try:
        out = ev(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        out = None
    if isinstance(out, int):
        return out
    if isinstance(out, list) and all(isinstance(v, int) for v in out):
        return tuple(out)
    raise ConfigError(f"--moe-layer-freq {value!r}: expected an integer N or a list of 0/1 per "
                      "layer such as '[1,0,1,0]' or '([1]*3+[0])*2'")


FLAGS: tuple[Flag, ...] = (
    # parallelism
    _f("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size", **_I),
    _f("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size", **_I),
    _f("--num-layers-per-virtual-pipeline-stage",
       "parallel.num_layers_per_virtual_pipeline_stage", **_I),
    _f("--microbatch-group-size-per-virtual-pipeline-stage",
       "parallel.microbatch_group_size_per_vp_stage", **_I),
    _f("--pipeline-schedule", "parallel.pipeline_schedule", type=pipeline_schedule_name,
       help="the pipeline schedule: 1f1b, interleaved (with virtual stages), zb-h1 (1F1B with "
            "the weight gradients filling the bubble: a third of 1F1B's at its memory), zbv "
            "(two chunks per rank in a V, near-zero bubble at 1F1B's memory), dualpipev "
            "(DeepSeek's V, F of one micro-batch with B of another; needs 2 x pp "
            "micro-batches); torchtitan's 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV "
            "accepted. Default: 1f1b, or interleaved with "
            "--num-layers-per-virtual-pipeline-stage"),
    _f("--delay-wgrad-compute", "parallel.delay_wgrad_compute", **_ON,
       help="1F1B with each backward's weight gradients computed after its exchange"),
    _f("--decoder-first-pipeline-num-layers", "parallel.decoder_first_pipeline_num_layers",
       **_I, help="transformer layers of the first (virtual) pipeline stage; the others split "
                  "the rest evenly"),
    _f("--decoder-last-pipeline-num-layers", "parallel.decoder_last_pipeline_num_layers",
       **_I, help="transformer layers of the last (virtual) pipeline stage"),
    _f("--account-for-embedding-in-pipeline-split",
       "parallel.account_for_embedding_in_pipeline_split", **_ON,
       help="count the embedding as one layer of the first stage when splitting"),
    _f("--account-for-loss-in-pipeline-split", "parallel.account_for_loss_in_pipeline_split",
       **_ON, help="count the output layer and loss as one layer of the last stage"),
    _f("--pipeline-model-parallel-layout", "parallel.pipeline_model_parallel_layout",
       help="every virtual stage's layers, Megatron's string: stages separated by |, E the "
            "embedding, t a transformer layer, L the loss, e.g. 'Et*3|t*4|t*3L' or "
            "'E|(t*2|)*4L'"),
    _f("--sequence-parallel", "parallel.sequence_parallel", **_ON),
    _f("--tp-comm-overlap", "parallel.tp_comm_overlap", **_ON,
       help="run the sequence-parallel all-gathers and reduce-scatters inside the linear "
            "layers' GEMMs (ring chunks forward, bulk overlap backward); needs "
            "--sequence-parallel"),
    _f("--disable-tp-comm-overlap-ag", "parallel.tp_comm_overlap_ag", lambda v: not v, **_ON,
       help="--tp-comm-overlap: keep the all-gathers before the GEMMs"),
    _f("--disable-tp-comm-overlap-rs", "parallel.tp_comm_overlap_rs", lambda v: not v, **_ON,
       help="--tp-comm-overlap: keep the row-parallel reduce-scatter after its GEMM"),
    _f("--tp-comm-overlap-rs-dgrad", "parallel.tp_comm_overlap_rs_dgrad", **_ON,
       help="--tp-comm-overlap: pipeline the input gradient's reduce-scatter with the dgrad "
            "GEMM instead of hiding it under the wgrad GEMM"),
    _f("--disable-tp-comm-bulk-dgrad", "parallel.tp_comm_bulk_dgrad", lambda v: not v, **_ON,
       help="--tp-comm-overlap: gather the input for the weight gradient before the dgrad "
            "GEMM"),
    _f("--disable-tp-comm-bulk-wgrad", "parallel.tp_comm_bulk_wgrad", lambda v: not v, **_ON,
       help="--tp-comm-overlap: reduce-scatter the input gradient before the wgrad GEMM"),
    _f("--context-parallel-size", "parallel.context_parallel_size", **_I,
       help="ranks that split each sequence (CP); weights are replicated over them"),
    _f("--cp-comm-type", "parallel.cp_comm_type",
       help="how attention crosses the sequence split: p2p (ring, default), all_gather, a2a "
            "(Ulysses: heads and query groups / TP divisible by CP)"),
    _f("--recompute-granularity", "parallel.recompute_granularity"),
    _f("--recompute-method", "parallel.recompute_method"),
    _f("--recompute-num-layers", "parallel.recompute_num_layers", **_I),
    _f("--distribute-saved-activations", "parallel.distribute_saved_activations", **_ON),
    _f("--distributed-backend", "parallel.distributed_backend"),
    _f("--distributed-timeout-minutes", "parallel.distributed_timeout_minutes", **_FL,
       help="timeout of every process group's collectives, and the watchdog's limit for one "
            "iteration"),
    _f("--expert-model-parallel-size", "parallel.expert_model_parallel_size", **_I),
    _f("--expert-tensor-parallel-size", "parallel.expert_tensor_parallel_size", **_I),
    # Mixture of Experts
    _f("--num-experts", "model.moe.num_experts", **_I),
    _f("--moe-ffn-hidden-size", "model.moe.moe_ffn_hidden_size", **_I),
    _f("--moe-layer-freq", "model.moe.moe_layer_freq", _layer_freq),
    _f("--moe-router-topk", "model.moe.moe_router_topk", **_I),
    _f("--moe-router-score-function", "model.moe.moe_router_score_function"),
    _f("--moe-router-pre-softmax", "model.moe.moe_router_pre_softmax", **_ON),
    _f("--moe-router-topk-scaling-factor", "model.moe.moe_router_topk_scaling_factor", **_FL),
    _f("--moe-router-load-balancing-type", "model.moe.moe_router_load_balancing_type"),
    _f("--moe-aux-loss-coeff", "model.moe.moe_aux_loss_coeff", **_FL),
    _f("--moe-z-loss-coeff", "model.moe.moe_z_loss_coeff", **_FL),
    _f("--moe-router-enable-expert-bias", "model.moe.moe_router_enable_expert_bias", **_ON),
    _f("--moe-router-bias-update-rate", "model.moe.moe_router_bias_update_rate", **_FL),
    _f("--moe-expert-capacity-factor", "model.moe.moe_expert_capacity_factor", **_FL),
    _f("--moe-token-drop-policy", "model.moe.moe_token_drop_policy"),
    _f("--moe-pad-expert-input-to-capacity", "model.moe.moe_pad_expert_input_to_capacity",
       **_ON),
    _f("--moe-grouped-gemm", "model.moe.moe_grouped_gemm", **_ON),
    _f("--moe-shared-expert-intermediate-size",
       "model.moe.moe_shared_expert_intermediate_size", **_I),
    _f("--moe-shared-expert-gate", "model.moe.moe_shared_expert_gate", **_ON),
    _f("--moe-shared-expert-overlap", "model.moe.moe_shared_expert_overlap", **_ON,
       help="the shared expert computes while the dispatch all-to-all is in flight"),
    _f("--overlap-moe-expert-parallel-comm", "parallel.overlap_moe_expert_parallel_comm", **_ON,
       help="combined 1F1B: the forward of one micro-batch and the backward of another run "
            "layer by layer in turns, each one's all-to-alls in flight under the other's "
            "compute (alltoall dispatcher, expert parallel > 1)"),
    _f("--moe-token-dispatcher-type", "model.moe.moe_token_dispatcher_type"),
    _f("--moe-per-layer-logging", "model.moe.moe_per_layer_logging", **_ON),
    _f("--moe-router-num-groups", "model.moe.moe_router_num_groups", **_I),
    _f("--moe-router-group-topk", "model.moe.moe_router_group_topk", **_I),
    _f("--moe-router-dtype", "model.moe.moe_router_dtype"),
    # model
    _f("--model-preset", "model.model_preset",
       help="start the model from a preset; flags given explicitly override it"),
    _f("--num-layers", "model.num_layers", **_I),
    _f("--hidden-size", "model.hidden_size", **_I),
    _f("--num-attention-heads", "model.num_attention_heads", **_I),
    _f("--group-query-attention", "model.group_query_attention", **_ON),
    _f("--num-query-groups", "model.num_query_groups", **_I),
    _f("--ffn-hidden-size", "model.ffn_hidden_size", **_I),
    _f("--seq-length", "model.seq_length", **_I),
    _f("--max-position-embeddings", "model.max_position_embeddings", **_I),
    _f("--position-embedding-type", "model.position_embedding_type"),
    _f("--rotary-base", "model.rotary_base", **_FL),
    _f("--rotary-percent", "model.rotary_percent", **_FL),
    _f("--normalization", "model.normalization", type=normalization_name),
    _f("--norm-epsilon", "model.norm_epsilon", **_FL),
    _f("--swiglu", "model.swiglu", **_ON),
    _f("--openai-gelu", "model.openai_gelu", **_ON),
    _f("--disable-bias-linear", "model.add_bias_linear", lambda v: not v, **_ON),
    _f("--add-qkv-bias", "model.add_qkv_bias", **_ON),
    _f("--qk-layernorm", "model.qk_layernorm", **_ON),
    _f("--multi-latent-attention", "model.multi_latent_attention", **_ON,
       help="multi-head latent attention (DeepSeek-V2/V3): keys/values (and queries with "
            "--q-lora-rank) through a low-rank latent, decoupled RoPE"),
    _f("--q-lora-rank", "model.q_lora_rank", **_I,
       help="MLA: the queries' latent width (default: queries by one projection)"),
    _f("--kv-lora-rank", "model.kv_lora_rank", **_I, help="MLA: the keys' and values' latent"),
    _f("--qk-head-dim", "model.qk_head_dim", **_I,
       help="MLA: each head's query/key width without position"),
    _f("--qk-pos-emb-head-dim", "model.qk_pos_emb_head_dim", **_I,
       help="MLA: the rotated query/key width (the key's part shared by all heads)"),
    _f("--v-head-dim", "model.v_head_dim", **_I, help="MLA: each head's value width"),
    _f("--rotary-scaling-factor", "model.rotary_scaling_factor", **_FL,
       help="YaRN: the context-extension factor of the rotary tables (1: none)"),
    _f("--mscale", "model.mscale", **_FL, help="YaRN: the rotary tables' temperature mscale"),
    _f("--mscale-all-dim", "model.mscale_all_dim", **_FL,
       help="YaRN: the mscale of the softmax scale (DeepSeek-V3: equal to --mscale)"),
    _f("--mtp-num-layers", "model.mtp_num_layers", **_I,
       help="multi-token prediction: modules after the main model, module k predicting the "
            "token k + 1 ahead (DeepSeek-V3: 1)"),
    _f("--mtp-loss-scaling-factor", "model.mtp_loss_scaling_factor", **_FL,
       help="weight of the mean of the MTP modules' losses added to the main loss"),
    _f("--original-max-position-embeddings", "model.original_max_position_embeddings", **_I,
       help="YaRN: the sequence length the rotary frequencies were trained at"),
    _f("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights",
       **_ON),
    _f("--attention-dropout", "model.attention_dropout", **_FL),
    _f("--hidden-dropout", "model.hidden_dropout", **_FL),
    _f("--init-method-std", "model.init_method_std", **_FL),
    _f("--kv-channels", "model.kv_channels", **_I),
    _f("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", **_I),
    _f("--vocab-size", "model.vocab_size", **_I),
    _f("--use-flash-attn", "model.use_flash_attn", dest="use_flash_attn", **_ON),
    _f("--no-flash-attn", "model.use_flash_attn", dest="use_flash_attn", action="store_false"),
    _f("--bias-gelu-fusion", "model.bias_gelu_fusion", dest="bias_gelu_fusion", **_ON),
    _f("--no-bias-gelu-fusion", "model.bias_gelu_fusion", dest="bias_gelu_fusion",
       action="store_false"),
    _f("--bias-swiglu-fusion", "model.bias_swiglu_fusion", dest="bias_swiglu_fusion", **_ON),
    _f("--no-bias-swiglu-fusion", "model.bias_swiglu_fusion", dest="bias_swiglu_fusion",
       action="store_false"),
    _f("--bias-dropout-fusion", "model.bias_dropout_fusion", dest="bias_dropout_fusion", **_ON),
    _f("--no-bias-dropout-fusion", "model.bias_dropout_fusion", dest="bias_dropout_fusion",
       action="store_false"),
    _f("--apply-rope-fusion", "model.apply_rope_fusion", dest="apply_rope_fusion", **_ON),
    _f("--no-rope-fusion", "model.apply_rope_fusion", dest="apply_rope_fusion",
       action="store_false"),
    _f("--fusions-on-cpu", "model.fusions_on_cpu", **_ON),
    # batch and training length
    _f("--micro-batch-size", "train.micro_batch_size", **_I),
    _f("--global-batch-size", "train.global_batch_size", **_I),
    _f("--train-iters", "train.train_iters", **_I),
    _f("--train-samples", "train.train_samples", **_I),
    _f("--seed", "train.seed", **_I),
    _f("--deterministic-mode", "train.deterministic_mode", **_ON),
    _f("--eval-interval", "train.eval_interval", **_I),
    _f("--eval-iters", "train.eval_iters", **_I),
    _f("--exit-interval", "train.exit_interval", **_I),
    _f("--exit-duration-in-mins", "train.exit_duration_in_mins", **_FL),
    _f("--check-for-nan-in-loss-and-grad", "train.check_for_nan_in_loss_and_grad",
       dest="check_for_nan_in_loss_and_grad", **_ON,
       help="skip a step with a NaN/inf loss or gradient (default: on)"),
    _f("--no-check-for-nan-in-loss-and-grad", "train.check_for_nan_in_loss_and_grad",
       dest="check_for_nan_in_loss_and_grad", action="store_false",
       help="apply updates whatever their values (fp16 still skips overflow steps)"),
    _f("--max-nonfinite-steps", "train.max_nonfinite_steps", **_I,
       help="stop after this many NaN/inf steps in a row"),
    _f("--spike-factor", "train.spike_factor", **_FL,
       help="a step whose loss is more than this many times max(1, the median of the recent "
            "sound steps' losses), or whose grad norm is more than this many times theirs, is "
            "a spike and is not saved; 0 turns the check off"),
    _f("--rampup-batch-size", "train.rampup_batch_size", tuple, nargs=3, type=int,
       metavar=("START", "INCREMENT", "SAMPLES")),
    _f("--manual-gc", "train.manual_gc", **_ON),
    _f("--manual-gc-interval", "train.manual_gc_interval", **_I),
    _f("--no-manual-gc-eval", "train.manual_gc_eval", lambda v: not v, **_ON),
    _f("--spike-window", "train.spike_window", **_I,
       help="how many recent sound steps the spike check takes the median over"),
    _f("--max-spike-steps", "train.max_spike_steps", **_I,
       help="stop after this many spiked steps in a row (a loss that stays finite but far "
            "above the recent median: the run diverged without NaN)"),
    # optimizer and learning rate
    _f("--lr", "optimizer.lr", **_FL),
    _f("--min-lr", "optimizer.min_lr", **_FL),
    _f("--lr-decay-style", "optimizer.lr_decay_style"),
    _f("--lr-warmup-iters", "optimizer.lr_warmup_iters", **_I),
    _f("--lr-decay-iters", "optimizer.lr_decay_iters", **_I),
    _f("--lr-warmup-fraction", "optimizer.lr_warmup_fraction", **_FL),
    _f("--lr-warmup-samples", "optimizer.lr_warmup_samples", **_I),
    _f("--lr-decay-samples", "optimizer.lr_decay_samples", **_I),
    _f("--optimizer", "optimizer.optimizer", _megatron_optimizer, choices=("adam", "sgd")),
    _f("--sgd-momentum", "optimizer.sgd_momentum", **_FL),
    _f("--weight-decay", "optimizer.weight_decay", **_FL),
    _f("--adam-beta1", "optimizer.adam_beta1", **_FL),
    _f("--adam-beta2", "optimizer.adam_beta2", **_FL),
    _f("--adam-eps", "optimizer.adam_eps", **_FL),
    _f("--clip-grad", "optimizer.clip_grad", **_FL),
    # mixed precision
    _f("--fp16", "precision.fp16", **_ON),
    _f("--bf16", "precision.bf16", **_ON),
    _f("--loss-scale", "precision.loss_scale", **_FL),
    _f("--initial-loss-scale", "precision.initial_scale_power", _initial_loss_scale_power,
       help="initial dynamic loss scale, a power of two (fp16.initial_scale_power = log2)",
       **_FL),
    _f("--min-loss-scale", "precision.min_loss_scale", **_FL),
    _f("--loss-scale-window", "precision.loss_scale_window", **_I),
    _f("--hysteresis", "precision.hysteresis", **_I),
    _f("--accumulate-allreduce-grads-in-fp32", "precision.grad_accum_dtype", lambda v: "fp32",
       **_ON),
    # FP8 (megazero.fp8)
    _f("--fp8-format", "precision.fp8_format"),
    _f("--fp8-recipe", "precision.fp8_recipe"),
    _f("--fp8-amax-history-len", "precision.fp8_amax_history_len", **_I),
    _f("--fp8-amax-compute-algo", "precision.fp8_amax_compute_algo"),
    _f("--fp8-margin", "precision.fp8_margin", **_I),
    _f("--first-last-layers-bf16", "precision.first_last_layers_bf16", **_ON),
    _f("--num-layers-at-start-in-bf16", "precision.num_layers_at_start_in_bf16", **_I),
    _f("--num-layers-at-end-in-bf16", "precision.num_layers_at_end_in_bf16", **_I),
    _f("--fp8-param-gather", "precision.fp8_param_gather", **_ON),
    _f("--log-fp8-amax", "logging.log_fp8_amax", tuple, nargs="+"),
    # ZeRO and the DeepSpeed config
    _f("--zero-stage", "zero.stage", type=int,
       help="ZeRO stage; the same as zero_optimization.stage in the JSON"),
    _f("--overlap-grad-reduce", "zero.overlap_comm", dest="overlap_grad_reduce", **_ON),
    _f("--no-overlap-grad-reduce", "zero.overlap_comm", dest="overlap_grad_reduce",
       action="store_false"),
    _f("--overlap-param-gather", "zero.overlap_param_gather", dest="overlap_param_gather",
       **_ON),
    _f("--no-overlap-param-gather", "zero.overlap_param_gather", dest="overlap_param_gather",
       action="store_false"),
    _f("--ddp-bucket-size", "zero.reduce_bucket_size", **_I),
    _f("--deepspeed_config --deepspeed-config", "deepspeed_config", dest="deepspeed_config",
       help="DeepSpeed JSON config (// and /* */ comments allowed; \"auto\" takes the flags)"),
    _f("--deepspeed", "deepspeed", help="accepted for Megatron-DeepSpeed scripts; no effect",
       **_ON),
    # data
    _f("--data-path", "data.data_path", lambda v: tuple(t for x in v for t in x.split()),
       nargs="+", help='"PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (weights for blending)'),
    _f("--split", "data.split", type=split_proportions),
    _f("--mock-data", "data.mock_data", **_ON),
    _f("--tokenizer-type", "data.tokenizer_type", choices=TOKENIZER_TYPES),
    _f("--tokenizer-model", "data.tokenizer_model"),
    _f("--vocab-file", "data.vocab_file"),
    _f("--merge-file", "data.merge_file"),
    _f("--data-cache-path", "data.data_cache_path"),
    _f("--eod-mask-loss", "data.eod_mask_loss", **_ON),
    _f("--reset-position-ids", "data.reset_position_ids", **_ON,
       help="positions restart at 0 after each end-of-document token of a packed sequence"),
    _f("--reset-attention-mask", "data.reset_attention_mask", **_ON,
       help="tokens attend only to their own document of a packed sequence"),
    # checkpoints
    _f("--save", "checkpoint.save"),
    _f("--load", "checkpoint.load"),
    _f("--save-interval", "checkpoint.save_interval", **_I),
    _f("--no-load-optim", "checkpoint.no_load_optim", **_ON),
    _f("--no-load-rng", "checkpoint.no_load_rng", **_ON),
    _f("--finetune", "checkpoint.finetune", **_ON),
    _f("--override-opt_param-scheduler", "checkpoint.override_opt_param_scheduler", **_ON),
    _f("--use-checkpoint-opt_param-scheduler", "checkpoint.use_checkpoint_opt_param_scheduler",
       **_ON),
    _f("--use-checkpoint-args", "checkpoint.use_checkpoint_args", **_ON),
    _f("--overwrite-checkpoints", "checkpoint.overwrite_checkpoints", **_ON),
    _f("--async-save", "checkpoint.async_save", **_ON,
       help="write checkpoints in the background: each rank copies its state to host memory "
            "at the save step and training goes on; latest moves once every rank's files are "
            "complete"),
    _f("--exit-on-save-failure", "checkpoint.exit_on_save_failure", **_ON,
       help="stop the run when an asynchronous save fails (default: log it and train on; the "
            "previous checkpoint stays the latest)"),
    # logging
    _f("--log-interval", "logging.log_interval", **_I),
    _f("--tensorboard-dir", "logging.tensorboard_dir"),
    _f("--log-memory-phases", "logging.log_memory_phases", **_ON),
    _f("--log-straggler", "logging.log_straggler", **_ON,
       help="every log interval, the slowest and fastest ranks' busy time per iteration (wall "
            "time minus waits in collectives) and their spread; a rank that stays slow is "
            "named in a warning"),
    _f("--straggler-minmax-count", "logging.straggler_minmax_count", **_I,
       help="how many of the slowest and fastest ranks the straggler line lists"),
    _f("--straggler-factor", "logging.straggler_factor", **_FL,
       help="a rank whose busy time is more than this many times the median is slow"),
    _f("--straggler-patience", "logging.straggler_patience", **_I,
       help="log intervals in a row a rank must be slow before the warning names it"),
    _f("--wall-clock-breakdown", "logging.wall_clock_breakdown", **_ON),
    _f("--log-num-zeros-in-grad", "logging.log_num_zeros_in_grad", **_ON),
    _f("--log-json", "logging.log_json", metavar="PATH"),
    _f("--profile", "logging.profile", **_ON),
    _f("--use-pytorch-profiler", "logging.use_pytorch_profiler", **_ON),
    _f("--profile-step-start", "logging.profile_step_start", **_I),
    _f("--profile-step-end", "logging.profile_step_end", **_I),
    _f("--profile-ranks", "logging.profile_ranks", tuple, nargs="+", type=int),
    # flags of published Megatron-LM and Megatron-DeepSpeed scripts (megazero.config.script_flags)
    *SCRIPT_FLAGS,
)


def field_default(path: str) -> Any:
    """The dataclass default of a dotted MegazeroConfig field path such as ``zero.stage``."""
    cls: Any = MegazeroConfig
    default: Any = None
    for part in path.split("."):
        f = {f.name: f for f in fields(cls)}[part]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore
        cls = type(default)
    return default


def _dest(flag: Flag) -> str:
    return flag.kwargs.get("dest") or flag.names[0].lstrip("-").replace("-", "_")


def _help(flag: Flag) -> str:
    """One line of meaning, the default and the config field, for ``--help``."""
    meaning = HELP.get(flag.names[0]) or flag.kwargs.get("help", "")
    action = flag.kwargs.get("action")
    if action in ("store_true", "store_false"):
        on = action == "store_true" and flag.convert is None and field_default(flag.field) is True
        default = "on" if on else "off"
    else:
        default = field_default(flag.field)
        if flag.convert is not None and default is not None and flag.names[0] != "--data-path":
            default = f"{default} ({flag.field})"
    if isinstance(default, tuple):
        default = " ".join(map(str, default)) or None
    shown = "none" if default is None else str(default)
    if "(default" in meaning:  # the meaning says what the default is
        return meaning.replace("%", "%%")
    return f"{meaning}{'; ' if meaning else ''}default: {shown}".replace("%", "%%")


def _group(flag: Flag) -> str:
    return GROUP_OF_FLAG.get(flag.names[0]) or SCRIPT_FLAG_GROUPS.get(flag.names[0]) or \
        GROUP_OF_SECTION.get(
        flag.field.split(".")[0], "ZeRO and DeepSpeed config")


@functools.lru_cache(maxsize=2)
def build_parser(*, explicit_only: bool = False) -> argparse.ArgumentParser:
    """The command-line parser, flags grouped under Megatron's headings. With ``explicit_only``
    every default is suppressed, so the namespace holds exactly the flags that were typed (used to
    detect flag-vs-JSON conflicts); that parser has no ``--help`` of its own
    (:func:`parse_args` prints the full parser's help). Built once per kind (parsing does not
    change it): the layout search parses thousands of command lines."""
    parser = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=not explicit_only,
                     exit_on_error=False,
                     usage="torchrun [--nproc_per_node N ...] %(prog)s [flags]",
                     description="Pretrain a GPT model (Megatron flags, DeepSpeed JSON config).",
                     epilog="Errors print one line; set MEGAZERO_DEBUG=1 for tracebacks.")
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for flag in FLAGS:
        kw = dict(flag.kwargs)
        choices = field_choices(flag.field)
        if choices is not None and "action" not in kw and flag.convert is None:
            kw["choices"] = choices
        if explicit_only:
            kw["default"] = argparse.SUPPRESS
            kw.pop("help", None)
        else:
            if flag.convert is None:
                kw["default"] = field_default(flag.field)
            kw["help"] = _help(flag)
        group = groups.setdefault(_group(flag), parser.add_argument_group(_group(flag)))
        group.add_argument(*flag.names, **kw)
    return parser


def flag_values(args: argparse.Namespace | dict[str, Any],
                problems: list[str] | None = None) -> dict[str, tuple[str, Any]]:
    """field path -> (the flag as typed, the field value) for each flag in ``args``. A value
    its flag cannot take raises, or with ``problems`` is noted there and left out."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    out: dict[str, tuple[str, Any]] = {}
    for flag in FLAGS:
        dest, action = _dest(flag), flag.kwargs.get("action")
        if dest not in given:
            continue
        value = given[dest]
        if action in ("store_true", "store_false") and (action == "store_true") != bool(value):
            continue  # --no-flash-attn and --use-flash-attn share a dest: name the one typed
        try:
            out[flag.field] = (flag.names[0], flag.convert(value) if flag.convert else value)
        except ConfigError as e:
            if problems is None:
                raise
            problems.append(str(e))
    return out
