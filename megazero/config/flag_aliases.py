"""Flags from Megatron-LM and Megatron-DeepSpeed scripts that megazero spells differently.

Two tables, because the two cases need different answers:

* :data:`EQUIVALENT_FLAGS`: the same meaning as megazero flags; the command line is rewritten to
  them (``--use-rotary-position-embeddings`` is ``--position-embedding-type rope``). Flags that
  only tune a kernel megazero does not have (fusions) map to nothing and are accepted.
* :data:`RENAMED_FLAGS`: no flag of the same meaning; the error names what to write instead
  (``--cpu-offload`` is the JSON's ``zero_optimization.offload_optimizer``).
* :data:`NOT_YET`: flags of a feature megazero does not have yet (FP4): one message says which
  feature is missing, instead of one "unknown argument" per flag.

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
    # Megatron-DeepSpeed: full recomputation of every layer, unless the script also says how
    "--checkpoint-activations": ("--recompute-granularity", "full", "--recompute-method",
                                 "uniform"),
    "--no-query-key-layer-scaling": (),  # megazero never scales Q K^T by 1 / layer number
    "--no-position-embedding": ("--position-embedding-type", "rope"),
    "--deepscale_config": ("--deepspeed_config",),
    # Megatron-DeepSpeed: recompute through DeepSpeed's checkpointing, whose settings are the
    # JSON's activation_checkpointing block; megazero's recomputation reads that block anyway
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
    "--data-impl": "megazero reads Megatron's mmap indexed datasets, the only format it has",
    # DeepSpeed's launcher passes --local_rank=N; the rank also comes as LOCAL_RANK, which
    # megazero reads (megazero.distributed.device)
    "--local_rank": "the local rank is read from the launcher's LOCAL_RANK",
    "--local-rank": "the local rank is read from the launcher's LOCAL_RANK",
    # --tp-comm-overlap needs no Transformer Engine userbuffers: the chunks are the TP ranks'
    # sequence slices, exchanged over the TP group's own backend
    "--tp-comm-overlap-cfg": "--tp-comm-overlap has no userbuffers configuration: each "
                             "collective is split into the TP ranks' sequence chunks",
    "--tp-comm-bootstrap-backend": "--tp-comm-overlap exchanges its chunks over the TP "
                                   "group's own backend; there are no userbuffers to bootstrap",
}

#: the values an :data:`EQUIVALENT_WITH_VALUE` flag may take where its tool refuses others.
ACCEPTED_VALUES: dict[str, tuple[str, ...]] = {
    "--data-impl": ("mmap", "infer"),
    "--attention-backend": ("flash", "fused", "unfused", "local", "auto"),
}

#: flag -> the equivalent tokens, ``{}`` standing for the flag's value.
EQUIVALENT_WITH_ARG: dict[str, tuple[str, ...]] = {
    # Megatron-DeepSpeed's GQA spelling
    "--num-key-value-heads": ("--group-query-attention", "--num-query-groups", "{}"),
}

#: flag prefix or name -> the feature megazero does not have yet.
NOT_YET: dict[str, str] = {
    "--fp4": "FP4 training",
}

#: flag -> what to write instead (the flag itself is rejected).
RENAMED_FLAGS: dict[str, str] = {
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--batch-size": "--micro-batch-size",
    "--activations-checkpoint-method": "--recompute-method",
    "--sequence-parallel-size": "--sequence-parallel (a mode of the TP group)",
    "--warmup": "--lr-warmup-iters",
    "--cpu-offload": 'the DeepSpeed JSON: "zero_optimization": {"offload_optimizer": '
                     '{"device": "cpu"}} with --deepspeed_config',
    "--cpu-optimizer": 'the DeepSpeed JSON: "zero_optimization": {"offload_optimizer": '
                       '{"device": "cpu"}} with --deepspeed_config',
    "--zero-stage-3": "--zero-stage 3",
    "--use-flash-attn-v2": "--use-flash-attn",
    "--use-flash-attn-triton": "--use-flash-attn",
    "--no-load-lr-state": "--use-checkpoint-opt_param-scheduler or "
                          "--override-opt_param-scheduler",
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
    "--tokenizer-name-or-path": "--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH",
}


#: Megatron's distributed optimizer shards the optimizer state over data-parallel ranks: ZeRO-1.
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer"


def rewrite_aliases(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with every :data:`EQUIVALENT_FLAGS` / :data:`EQUIVALENT_WITH_ARG` flag replaced
    by its megazero tokens and every :data:`EQUIVALENT_WITH_VALUE` flag dropped with its value,
    and the problems found on the way (a value :data:`ACCEPTED_VALUES` refuses).
    ``--use-distributed-optimizer`` becomes ``--zero-stage 1`` unless the stage is given
    (``--zero-stage`` or a DeepSpeed JSON): every stage >= 1 shards the optimizer state.
    ``--checkpoint-activations`` leaves the recompute flags the script also types alone."""
    names = {t.partition("=")[0] for t in argv}
    stage_given = bool(names & {"--zero-stage", "--deepspeed_config", "--deepspeed-config",
                                "--deepscale_config"})
    out: list[str] = []
    problems: list[str] = []
    skip = False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        name, has_value, inline = token.partition("=")
        following = argv[i + 1] if i + 1 < len(argv) else None
        value = inline if has_value else (
            following if following is not None and not following.startswith("--") else None)
        if name == DISTRIBUTED_OPTIMIZER and not has_value:
            out.extend(() if stage_given else ("--zero-stage", "1"))
        elif name == "--checkpoint-activations" and not has_value:
            for flag, setting in (("--recompute-granularity", "full"),
                                  ("--recompute-method", "uniform")):
                if flag not in names:
                    out.extend((flag, setting))
        elif name in EQUIVALENT_FLAGS and not has_value:
            out.extend(EQUIVALENT_FLAGS[name])
        elif name in EQUIVALENT_WITH_ARG and value is not None:
            out.extend(t.replace("{}", value) for t in EQUIVALENT_WITH_ARG[name])
            skip = not has_value
        elif name in EQUIVALENT_WITH_VALUE:
            skip = not has_value and value is not None
            allowed = ACCEPTED_VALUES.get(name)
            if allowed and value not in allowed:
                problems.append(f"{name} {value}: megazero takes {' or '.join(allowed)} "
                                f"({EQUIVALENT_WITH_VALUE[name]})")
        else:
            out.append(token)
    return out, problems


def not_yet_reason(name: str) -> str | None:
    """The feature a :data:`NOT_YET` flag belongs to, or None for any other flag."""
    for prefix, feature in NOT_YET.items():
        if name == prefix or name.startswith(prefix + "-"):
            return feature
    return None


def not_yet_problem(tokens: Sequence[str]) -> str:
    """One message for every flag (with its values) of a feature megazero lacks."""
    features = sorted({not_yet_reason(t.split()[0].split("=")[0]) or "" for t in tokens})
    return (f"{' and '.join(features)} {'is' if len(features) == 1 else 'are'} not in megazero "
            f"yet, so {', '.join(tokens)} cannot apply; remove "
            f"{'it' if len(tokens) == 1 else 'them'} to train in --bf16 (or fp16/fp32)")


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
