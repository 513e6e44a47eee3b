"""Flags that published Megatron-LM and Megatron-DeepSpeed launch scripts pass, with the meaning
they have there: the token-based schedule and TensorBoard switches of Megatron-DeepSpeed, and
the data, tokenizer, optimizer and loss settings of Megatron-LM's current examples.

Kept as their own table (appended to :data:`megazero.config.cli.FLAGS`) so the core flag table
stays one screen and flags from other tools land here, grouped by where users meet them. Flags
of other tools that megazero spells differently or accepts without a value to keep are in
:mod:`megazero.config.flag_aliases`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from typing import TYPE_CHECKING, Any

from megazero.config.flag_types import FLOAT, INT, ON, Flag, flag

if TYPE_CHECKING:
    from megazero.config.schema import MegazeroConfig


def normalization_name(value: str) -> str:
    """``--normalization`` in any case: Megatron-DeepSpeed writes ``rmsnorm``/``layernorm``,
    Megatron-LM ``RMSNorm``/``LayerNorm``; an unknown name is left for argparse to refuse."""
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(value.lower(), value)


def split_proportions(value: str) -> str:
    """``--split``: the numbers read out of the string, as Megatron does, so a script's
    ``--split "'99,1,0'"`` (quotes kept by its shell array) is ``99,1,0``."""
    numbers = re.findall(r"[.0-9]+", value)
    if not numbers or len(numbers) > 3:
        raise argparse.ArgumentTypeError(f"expected up to three train,valid,test proportions "
                                         f"such as 969,30,1, got {value!r}")
    return ",".join(numbers)


def _paths(value: list[str]) -> tuple[str, ...]:
    return tuple(t for x in value for t in x.split())


def _bf16(value: Any) -> str:  # noqa: ARG001 (a switch: its presence is the value)
    return "bf16"


SCRIPT_FLAGS: tuple[Flag, ...] = (
    # Megatron-DeepSpeed: a schedule counted in tokens
    flag("--train-tokens", "train.train_tokens", **INT,
         help="stop once this many tokens are consumed (with --train-iters/--train-samples: "
              "whichever comes first)"),
    flag("--lr-warmup-tokens", "optimizer.lr_warmup_tokens", **INT,
         help="linear warm-up over this many tokens (instead of iterations)"),
    flag("--lr-decay-tokens", "optimizer.lr_decay_tokens", **INT,
         help="decay the learning rate over this many tokens (instead of iterations)"),
    # Megatron-DeepSpeed / Megatron-LM: what TensorBoard gets
    flag("--tensorboard-queue-size", "logging.tensorboard_queue_size", **INT,
         help="TensorBoard events held before a write to disk"),
    flag("--log-timers-to-tensorboard", "logging.log_timers_to_tensorboard", **ON,
         help="time each iteration's regions (forward, backward, collectives, optimizer...) and "
              "write them to TensorBoard as time/<region>_ms (the printed breakdown is "
              "--wall-clock-breakdown)"),
    flag("--log-batch-size-to-tensorboard", "logging.log_batch_size_to_tensorboard", **ON,
         help="also write 'batch-size vs samples' (x: consumed samples)"),
    flag("--log-optimizer-states-to-tensorboard",
         "logging.log_optimizer_states_to_tensorboard", **ON,
         help="write norms and maxima of the Adam moments and fp32 weights over the whole "
              "model (optimizer/momentum_l2, ...) at each log line"),
    flag("--log-validation-ppl-to-tensorboard", "logging.log_validation_ppl_to_tensorboard",
         **ON, help="also write 'lm loss validation ppl vs samples' (x: consumed samples)"),
    flag("--wandb-project", "logging.wandb_project",
         help="log to Weights & Biases under this project (needs the wandb package)"),
    flag("--wandb-exp-name", "logging.wandb_exp_name", help="the wandb run's name"),
    flag("--wandb-save-dir", "logging.wandb_save_dir", help="where wandb writes its files"),
    # Megatron-LM: data and tokenizers
    flag("--train-data-path", "data.train_data_path", _paths, nargs="+",
         help="the training split's own corpus ([W1] PREFIX1 ...), instead of --data-path "
              "with --split"),
    flag("--valid-data-path", "data.valid_data_path", _paths, nargs="+",
         help="the validation split's own corpus"),
    flag("--test-data-path", "data.test_data_path", _paths, nargs="+",
         help="the test split's own corpus"),
    flag("--no-mmap-bin-files", "data.mmap_bin_files", lambda v: not v, **ON,
         help="read each .bin file into memory instead of mapping it"),
    flag("--tiktoken-pattern", "data.tiktoken_pattern",
         help="TikTokenizer's pre-tokenizer regex (v1 or v2, Megatron's)"),
    flag("--tiktoken-num-special-tokens", "data.tiktoken_num_special_tokens", **INT,
         help="TikTokenizer's ids reserved for special tokens before the vocabulary"),
    # Megatron-LM: model, optimizer, loss, memory
    flag("--apply-layernorm-1p", "model.apply_layernorm_1p", **ON,
         help="zero-centred norm weights: the norms scale by (1 + weight), weight starting "
              "at 0"),
    flag("--transformer-impl", "model.transformer_impl",
         help="accepted: megazero runs its own layers either way"),
    flag("--decoupled-lr", "optimizer.decoupled_lr", **FLOAT,
         help="peak learning rate of the input embedding and output layer"),
    flag("--decoupled-min-lr", "optimizer.decoupled_min_lr", **FLOAT,
         help="their minimum learning rate (default --min-lr)"),
    flag("--calculate-per-token-loss", "train.calculate_per_token_loss", **ON,
         help="average the loss over every token of the global batch (not per micro-batch)"),
    flag("--grad-reduce-in-bf16", "precision.grad_accum_dtype", _bf16, **ON,
         help="accumulate and reduce gradients in bf16 (data_types.grad_accum_dtype bf16)"),
    flag("--empty-unused-memory-level", "train.empty_unused_memory_level", **INT,
         choices=(0, 1, 2), help="return cached GPU memory to the driver: 1 after each "
                                 "iteration, 2 also after each evaluation"),
)

#: ``--help`` heading of each script flag (the others follow their config section).
SCRIPT_FLAG_GROUPS = {
    "--lr-warmup-tokens": "learning rate", "--lr-decay-tokens": "learning rate",
    "--decoupled-lr": "learning rate", "--decoupled-min-lr": "learning rate",
}


def script_notes(cfg: MegazeroConfig) -> list[str]:
    """One line for each script flag whose value megazero accepts but runs its own way."""
    notes = []
    if cfg.model.transformer_impl == "transformer_engine":
        te = importlib.util.find_spec("transformer_engine") is not None
        notes.append("--transformer-impl transformer_engine: megazero runs its own layers"
                     + (" (it does not call Transformer Engine)" if te else
                        " (Transformer Engine is not installed)"))
    return notes


def pipeline_schedule_name(value: str) -> str:
    """``--pipeline-schedule``: megazero's names, or torchtitan's (``1F1B``, ``Interleaved1F1B``,
    ``ZBVZeroBubble``, ``DualPipeV``); an unknown name is left for argparse to refuse."""
    return {"1F1B": "1f1b", "Interleaved1F1B": "interleaved", "ZBVZeroBubble": "zbv",
            "DualPipeV": "dualpipev", "ZBH1": "zb-h1"}.get(value, value)
