"""Run features the step-time model prices although megazero's training code does not have them.

Published runs use features that megazero cannot run yet (FP8 GEMMs, tensor-parallel
communication inside the GEMMs, the combined-1F1B expert-parallel overlap, Megatron's uneven
pipeline split, sliding-window attention). The planner still has to predict those runs, and a
user planning one has to see what the feature buys. :class:`Features` says which of them a run
uses; the step-time model (:mod:`megazero.planner.step_time`) prices each one from what it does
to the work (the bytes and FLOPs it changes, the communication it hides) and from cluster
numbers (the FP8 peak and efficiency in ``clusters/*.json``), never from a per-run constant.

When the training code gains a feature, its flag is read into these fields, in one place,
:func:`features_from_config`, so the planner's view of a run and the run itself cannot drift.
It reads the FP8 flags (``--fp8-format``, ``--fp8-recipe``, ``--fp8-param-gather``,
``--first-last-layers-bf16``) and the overlaps megazero runs (``--tp-comm-overlap``,
``--moe-shared-expert-overlap``, ``--overlap-moe-expert-parallel-comm``); the other fields
stay what the caller (a published run's description) sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config import MegazeroConfig
from megazero.errors import ConfigError

FP8_RECIPES = ("tensorwise", "delayed", "blockwise")


@dataclass(frozen=True)
class Features:
    """``fp8``: the transformer layers' linear layers (QKV, attention output, MLP and experts)
    run FP8 GEMMs with this scaling recipe (Megatron's ``--fp8-recipe``; ``tensorwise`` is
    Transformer Engine's current scaling: each GEMM input is scaled by its own amax, measured
    just before the cast); the embedding, the logits, the router and the core attention stay
    16-bit. ``fp8_param_gather``: parameters are all-gathered in FP8 (one byte each) by ZeRO /
    the distributed optimizer.

    ``tp_comm_overlap``: the sequence-parallel all-gathers and reduce-scatters run inside the
    linear layers' GEMMs (Megatron's ``--tp-comm-overlap``, Transformer Engine userbuffers; as
    megazero runs it: ring steps of ``1/tp`` chunks under the GEMM chunks, the backward's
    re-gather and reduce-scatter under whole GEMMs): each call's latency, and the bytes that
    outlast their GEMM, are exposed, and the chunked GEMMs lose efficiency (the cluster's
    ``gemm_half_rate_rows``; :mod:`megazero.planner.tp_cost`).
    ``moe_shared_expert_overlap``: the shared expert's forward runs while the forward dispatch
    all-to-all is in flight (``--moe-shared-expert-overlap``); the backward's all-to-alls and
    the combine stay exposed.
    ``moe_ep_overlap``: the dispatch and combine all-to-alls of one micro-batch run under
    another micro-batch's compute (megatron-core's combined 1F1B,
    ``--overlap-moe-expert-parallel-comm``), for the forwards and backwards the schedule
    pairs (:func:`megazero.planner.moe_cost.paired_share`); the others run alone.

    ``embedding_and_loss_slots``: Megatron's ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split``: the pipeline splits ``layers + 2`` slots evenly,
    the embedding taking the first stage's first slot and the loss the last stage's last one
    (the config then describes the slots: ``--num-layers`` is layers + 2).

    ``sliding_window`` / ``sliding_window_share``: that share of the layers attends to the
    last ``sliding_window`` positions only (GPT-OSS: 128 positions on every other layer).
    ``recompute_norms_and_moe_act``: Megatron's ``--recompute-modules layernorm moe_act``: the
    norms and the experts' activation function run their forward again in backward."""

    fp8: str | None = None
    fp8_param_gather: bool = False
    # the share of the transformer layers whose linears run FP8 (--first-last-layers-bf16
    # keeps the rest in 16 bits)
    fp8_layer_share: float = 1.0
    tp_comm_overlap: bool = False
    moe_ep_overlap: bool = False
    moe_shared_expert_overlap: bool = False
    embedding_and_loss_slots: bool = False
    sliding_window: int | None = None
    sliding_window_share: float = 0.0
    recompute_norms_and_moe_act: bool = False

    def __post_init__(self) -> None:
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ConfigError(f"planner feature fp8={self.fp8!r}: the step-time model prices "
                              f"the recipes {FP8_RECIPES}; use one of them or None")
        if not 0.0 <= self.fp8_layer_share <= 1.0:
            raise ConfigError(f"planner feature fp8_layer_share={self.fp8_layer_share}: "
                              "expected a share between 0 and 1")
        if not 0.0 <= self.sliding_window_share <= 1.0:
            raise ConfigError(f"planner feature sliding_window_share="
                              f"{self.sliding_window_share}: expected a share between 0 and 1")
        if self.sliding_window_share and not self.sliding_window:
            raise ConfigError("planner feature sliding_window_share needs sliding_window (the "
                              "number of positions each windowed layer attends to)")


def features_from_config(cfg: MegazeroConfig) -> Features:
    """The features a run's own config turns on: FP8 GEMMs (recipe, the share of layers that
    run them), FP8 parameter gathers, and the TP, shared-expert and combined-1F1B overlaps."""
    overlaps = dict(tp_comm_overlap=cfg.parallel.tp_comm_overlap,
                    moe_shared_expert_overlap=cfg.model.moe.moe_shared_expert_overlap,
                    moe_ep_overlap=cfg.parallel.overlap_moe_expert_parallel_comm)
    pr = cfg.precision
    if pr.fp8_format is None or pr.fp8_recipe not in FP8_RECIPES:
        return Features(**overlaps)
    n = cfg.model.num_layers
    kept = (pr.num_layers_at_start_in_bf16 + pr.num_layers_at_end_in_bf16
            if pr.first_last_layers_bf16 else 0)
    return Features(fp8=pr.fp8_recipe, fp8_param_gather=pr.fp8_param_gather,
                    fp8_layer_share=(n - min(kept, n)) / n, **overlaps)


def transformer_layers(cfg: MegazeroConfig, features: Features) -> int:
    """The model's transformer layers: the config's, less the embedding's and the loss's
    pipeline slots where :attr:`Features.embedding_and_loss_slots` says they hold two."""
    return cfg.model.num_layers - (2 if features.embedding_and_loss_slots else 0)
