"""Flags from Megatron-LM and Megatron-DeepSpeed scripts that megazero spells differently.

Two tables, because the two cases need different answers:

* :data:`EQUIVALENT_FLAGS`: the same meaning as megazero flags; the command line is rewritten to
  them (``--use-rotary-position-embeddings`` is ``--position-embedding-type rope``). Flags that
  only tune a kernel megazero does not have (fusions) map to nothing and are accepted.
* :data:`RENAMED_FLAGS`: no flag of the same meaning; the error names what to write instead
  (``--cpu-offload`` is the JSON's ``zero_optimization.offload_optimizer``).

An unknown flag in neither table gets the closest spelling, but only when the two names share
their meaning words (``--recompute-activations`` is not ``--recompute-method``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

#: flag -> megazero tokens that mean the same (empty: accepted, nothing to do here).
EQUIVALENT_FLAGS: dict[str, tuple[str, ...]] = {
    "--use-rotary-position-embeddings": ("--position-embedding-type", "rope"),
    "--recompute-activations": ("--recompute-granularity", "selective"),
    "--no-position-embedding": ("--position-embedding-type", "rope"),
    "--deepscale_config": ("--deepspeed_config",),
    "--deepspeed-activation-checkpointing": (),
    "--use-mcore-models": (),
    "--no-masked-softmax-fusion": (),
    "--no-gradient-accumulation-fusion": (),
    "--no-async-tensor-model-parallel-allreduce": (),
    "--use-fused-rmsnorm": (),
    "--no-persist-layer-norm": (),
    "--attention-softmax-in-fp32": (),
    "--exit-signal-handler": (),
    "--log-throughput": (),
    "--log-timers-to-tensorboard": ("--wall-clock-breakdown",),
    "--log-validation-ppl-to-tensorboard": (),
    "--cross-entropy-loss-fusion": (),
    "--overlap-p2p-communication": (),
    "--no-create-attention-mask-in-dataloader": (),
}

#: flag that takes a value -> it is accepted with no effect (the value is dropped too).
EQUIVALENT_WITH_VALUE: dict[str, str] = {
    "--num-workers": "samples are read from the mmap files in the training process",
    "--tensorboard-log-interval": "TensorBoard is written at every --log-interval",
    "--attention-backend": "flash-attn is used when installed and on GPU (--no-flash-attn: never)",
    "--ckpt-format": "megazero writes one portable format, which like torch_dist loads at any "
                     "layout",
    "--cross-entropy-fusion-impl": "the vocab-parallel loss is one implementation",
}

#: flag -> what to write instead (the flag itself is rejected).
RENAMED_FLAGS: dict[str, str] = {
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--batch-size": "--micro-batch-size",
    "--checkpoint-activations": "--recompute-granularity full --recompute-method uniform",
    "--activations-checkpoint-method": "--recompute-method",
    "--sequence-parallel-size": "--sequence-parallel (a mode of the TP group)",
    "--warmup": "--lr-warmup-iters",
    "--local_rank": "nothing: launch with torchrun, which sets LOCAL_RANK",
    "--local-rank": "nothing: launch with torchrun, which sets LOCAL_RANK",
    "--cpu-offload": 'the DeepSpeed JSON: "zero_optimization": {"offload_optimizer": '
                     '{"device": "cpu"}} with --deepspeed_config',
    "--cpu-optimizer": 'the DeepSpeed JSON: "zero_optimization": {"offload_optimizer": '
                       '{"device": "cpu"}} with --deepspeed_config',
    "--zero-stage-3": "--zero-stage 3",
    "--use-flash-attn-v2": "--use-flash-attn",
    "--use-flash-attn-triton": "--use-flash-attn",
    "--no-load-lr-state": "--use-checkpoint-opt_param-scheduler or "
                          "--override-opt_param-scheduler",
    "--wandb-project": 'the DeepSpeed JSON: "wandb": {"enabled": true, "project": "..."}',
    "--wandb-exp-name": 'the DeepSpeed JSON: "wandb": {"enabled": true, "group": "..."}',
    "--wandb-save-dir": 'the DeepSpeed JSON "wandb" block',
    "--train-data-path": "--data-path PREFIX with --split (separate train/valid/test files "
                         "are not implemented)",
    "--valid-data-path": "--data-path PREFIX with --split (separate train/valid/test files "
                         "are not implemented)",
    "--test-data-path": "--data-path PREFIX with --split (separate train/valid/test files are "
                        "not implemented)",
    "--eval-only": "nothing: evaluation-only runs are not implemented (validation runs every "
                   "--eval-interval and after the last iteration)",
    "--skip-train": "nothing: evaluation-only runs are not implemented (validation runs every "
                    "--eval-interval and after the last iteration)",
    "--no-save-optim": "nothing: checkpoints always hold the optimizer state (exact resume); "
                       "load with --no-load-optim or --finetune to drop it",
    "--no-save-rng": "nothing: checkpoints always hold the RNG states (exact resume); load with "
                     "--no-load-rng to drop them",
    "--log-params-norm": "nothing: the parameter norm is not logged (the log line has the "
                         "gradient norm)",
    "--fp32-residual-connection": "nothing: residuals follow --fp16/--bf16 (not implemented)",
    "--apply-query-key-layer-scaling": "nothing: attention scores are scaled by 1/sqrt(head "
                                       "dim) in fp32",
    "--transformer-impl": "nothing: megazero has one transformer implementation",
    "--tokenizer-name-or-path": "--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH",
}


#: Megatron's distributed optimizer shards the optimizer state over data-parallel ranks: ZeRO-1.
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer"


def rewrite_aliases(argv: Sequence[str]) -> list[str]:
    """``argv`` with every :data:`EQUIVALENT_FLAGS` flag replaced by its megazero tokens and
    every :data:`EQUIVALENT_WITH_VALUE` flag dropped with its value.
    ``--use-distributed-optimizer`` becomes ``--zero-stage 1`` unless the stage is given
    (``--zero-stage`` or a DeepSpeed JSON): every stage >= 1 shards the optimizer state."""
    names = {t.partition("=")[0] for t in argv}
    stage_given = bool(names & {"--zero-stage", "--deepspeed_config", "--deepspeed-config",
                                "--deepscale_config"})
    out: list[str] = []
    skip = False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        name, has_value, _ = token.partition("=")
        if name == DISTRIBUTED_OPTIMIZER and not has_value:
            out.extend(() if stage_given else ("--zero-stage", "1"))
        elif name in EQUIVALENT_FLAGS and not has_value:
            out.extend(EQUIVALENT_FLAGS[name])
        elif name in EQUIVALENT_WITH_VALUE:
            skip = not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        else:
            out.append(token)
    return out


def _words(flag: str) -> set[str]:
    return {w for w in flag.lstrip("-").replace("_", "-").split("-") if len(w) > 2}


def _near(word: str, words: set[str]) -> bool:
    return any(difflib.SequenceMatcher(None, word, w).ratio() >= 0.75 for w in words)


def suggest(name: str, known: Sequence[str], token: str) -> str:
    """The message for an unknown flag: its equivalent, or a close spelling whose meaning words
    are the same (each word equal or a typo of one), or a pointer to ``--help``."""
    if name in RENAMED_FLAGS:
        return f"{name} is not a megazero flag; use {RENAMED_FLAGS[name]}"
    if not name.startswith("-"):
        return f"unexpected value {token!r}; values follow their flag (see --help)"
    meaning = _words(name)
    candidates = [*known, *EQUIVALENT_FLAGS, *EQUIVALENT_WITH_VALUE, *RENAMED_FLAGS]
    for close in difflib.get_close_matches(name, candidates, n=5, cutoff=0.6):
        theirs = _words(close)
        if all(_near(w, theirs) for w in meaning) and all(_near(w, meaning) for w in theirs):
            return f"unknown argument {token!r}; did you mean {close}?"
    return f"unknown argument {token!r}; see --help for the flags"
