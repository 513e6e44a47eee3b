"""The Mixture-of-Experts section of the model config (Megatron's ``--num-experts`` and
``--moe-*`` flags), checked on its own here; the checks that involve the parallel layout
(experts divisible by the expert-parallel size, the expert grid dividing the world, TP needing
SP) are in :func:`megazero.config.rules.check_moe_layout`.

``num_experts`` None is a dense model: every other field is then unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megazero.config.rules import check as _check

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
#: Megatron's other balancing types, named so their refusal says why
NOT_IMPLEMENTED_BALANCING = ("sinkhorn", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("allgather", "alltoall")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # None: the dense --ffn-hidden-size
    # int N: layer i is MoE when i % N == 0; a list: one 0/1 per layer (Megatron's list form)
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_topk: int = 2
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "none", "sinkhorn", "global_aux_loss"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # the shared expert runs while the token dispatch all-to-all is in flight (megatron-core)
    moe_shared_expert_overlap: bool = False
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    moe_per_layer_logging: bool = False
    # group-limited (node-limited) routing: experts in equal groups, each token's top-k taken
    # from its best --moe-router-group-topk groups (DeepSeek-V3's n_group / topk_group)
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_dtype: Literal["fp32", "fp64"] | None = None  # None: fp32, megazero's default

    def __post_init__(self) -> None:
        if isinstance(self.moe_layer_freq, list):  # read back from JSON
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.num_experts is None:
            return
        e = self.num_experts
        _check(isinstance(e, int) and e >= 1,
               f"--num-experts must be a positive integer, got {e!r}")
        _check(1 <= self.moe_router_topk <= e,
               f"--moe-router-topk {self.moe_router_topk} must be between 1 and --num-experts "
               f"{e}")
        _check(self.moe_router_score_function in SCORE_FUNCTIONS,
               f"--moe-router-score-function {self.moe_router_score_function!r}: expected one of "
               f"{SCORE_FUNCTIONS}")
        kind = self.moe_router_load_balancing_type
        _check(kind != "sinkhorn" or self.moe_expert_capacity_factor is None,
               f"--moe-expert-capacity-factor {self.moe_expert_capacity_factor} does not apply "
               "with --moe-router-load-balancing-type sinkhorn (Megatron drops no tokens there); "
               "use aux_loss, seq_aux_loss or none with a capacity factor")
        _check(kind not in NOT_IMPLEMENTED_BALANCING,
               f"--moe-router-load-balancing-type {kind} is not implemented in megazero; use "
               f"one of {LOAD_BALANCING_TYPES}")
        _check(self.moe_router_load_balancing_type in LOAD_BALANCING_TYPES,
               f"--moe-router-load-balancing-type {self.moe_router_load_balancing_type!r}: "
               f"megazero implements {LOAD_BALANCING_TYPES}")
        _check(self.moe_token_drop_policy in DROP_POLICIES,
               f"--moe-token-drop-policy {self.moe_token_drop_policy!r}: expected one of "
               f"{DROP_POLICIES}")
        _check(self.moe_token_dispatcher_type in DISPATCHERS,
               f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}: expected one of "
               f"{DISPATCHERS}")
        _check(not self.moe_router_enable_expert_bias
               or self.moe_router_score_function == "sigmoid",
               "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the "
               "aux-loss-free bias shifts sigmoid scores); add it or drop the expert bias")
        _check(not (self.moe_router_pre_softmax
                    and self.moe_router_score_function != "softmax"),
               "--moe-router-pre-softmax applies to softmax scores only; drop it or use "
               "--moe-router-score-function softmax")
        cf = self.moe_expert_capacity_factor
        _check(cf is None or cf > 0,
               f"--moe-expert-capacity-factor must be > 0, got {cf}")
        _check(not self.moe_pad_expert_input_to_capacity or cf is not None,
               "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor; give "
               "a capacity factor or drop the padding flag")
        _check(self.moe_aux_loss_coeff >= 0,
               f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        freq = self.moe_layer_freq
        _check((isinstance(freq, int) and freq >= 1)
               or (isinstance(freq, tuple) and all(v in (0, 1) for v in freq)),
               f"--moe-layer-freq {freq!r}: expected a positive integer N (layer i is MoE when "
               "i % N == 0) or a list of 0/1, one per layer")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and v > 0),
                   f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        _check(not self.moe_shared_expert_gate
               or self.moe_shared_expert_intermediate_size is not None,
               "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        _check(not self.moe_shared_expert_overlap
               or self.moe_shared_expert_intermediate_size is not None,
               "--moe-shared-expert-overlap runs the shared expert under the dispatch "
               "all-to-all, and there is none: add --moe-shared-expert-intermediate-size or "
               "drop --moe-shared-expert-overlap")
        _check(not self.moe_shared_expert_overlap
               or self.moe_token_dispatcher_type == "alltoall",
               "--moe-shared-expert-overlap hides the dispatch all-to-all, and "
               f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type} has none: add "
               "--moe-token-dispatcher-type alltoall or drop --moe-shared-expert-overlap")
        _check(self.moe_router_dtype in (None, "fp32", "fp64"),
               f"--moe-router-dtype {self.moe_router_dtype!r}: expected fp32 or fp64")
        self._check_groups()

    def _check_groups(self) -> None:
        g, gk, e = self.moe_router_num_groups, self.moe_router_group_topk, self.num_experts
        assert e is not None
        if g is None:
            _check(gk is None, f"--moe-router-group-topk {gk} needs --moe-router-num-groups; "
                   "give the number of expert groups or drop --moe-router-group-topk")
            return
        _check(isinstance(g, int) and g >= 1 and e % g == 0,
               f"--moe-router-num-groups {g} must divide --num-experts {e} into equal groups; "
               "use a divisor of the expert count")
        _check(gk is not None and 1 <= gk <= g,
               f"--moe-router-group-topk {gk!r} must be between 1 and --moe-router-num-groups "
               f"{g}: the groups each token may route to")
        assert gk is not None
        _check(self.moe_router_topk <= gk * (e // g),
               f"--moe-router-topk {self.moe_router_topk} exceeds the {gk * (e // g)} experts of "
               f"--moe-router-group-topk {gk} groups of {e // g}; raise --moe-router-group-topk "
               "or lower --moe-router-topk")

    @property
    def enabled(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, layer: int, num_layers: int) -> bool:
        """Whether global layer ``layer`` (0-based) of ``num_layers`` has an MoE MLP."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return layer % freq == 0
        _check(len(freq) == num_layers,
               f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {num_layers}; "
               "give one 0/1 per layer")
        return bool(freq[layer])
