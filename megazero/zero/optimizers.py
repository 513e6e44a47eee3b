"""Which stock torch optimizers run on ZeRO's fp32 master shards, and what each keeps per element.

The ZeRO optimizer does not pick the update rule: it takes an *optimizer factory* (a callable
``groups -> torch.optim.Optimizer``, as nanotron's ``optimizer_builder``) and the caller's param
groups, and builds the torch optimizer over the master pieces of each group's parameters.

What it must know about that optimizer is its per-element state (:class:`OptimizerKind`): the
portable checkpoint gathers each parameter's state tensors by name, the NVMe swap streams them
through files, and a checkpoint written by one optimizer must not be read by another. Only
optimizers listed in :data:`KINDS` are accepted; their update is elementwise, so running them on
any cut of a parameter into pieces gives the same numbers as on the whole parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megazero.config import ConfigError, OptimizerConfig
from megazero.optim.lamb import Lamb
from megazero.optim.onebit import OneBitAdam
from megazero.optim.onebit_lamb import OneBitLamb
from megazero.optim.zeroone import ZeroOneAdam
from megazero.zero.lion import Lion

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerKind:
    name: str  # recorded in checkpoints: a checkpoint loads only into the same kind
    cls: type[torch.optim.Optimizer]
    state: tuple[str, ...]  # fp32 tensors shaped like the parameter, in the optimizer's state
    has_step: bool  # a per-parameter "step" counter (a scalar tensor) beside them
    hyper: tuple[str, ...]  # group settings taken from a caller's optimizer
    unsupported: tuple[str, ...]  # group flags that must be off
    # the update needs each whole parameter's norm (Lamb): stepped in two phases around one
    # reduction over the pieces' ranks (megazero.optim.whole_norms), not elementwise
    whole_norms: bool = False


_ADAM_HYPER = ("lr", "betas", "eps", "weight_decay")
KINDS: dict[type[torch.optim.Optimizer], OptimizerKind] = {
    torch.optim.AdamW: OptimizerKind("AdamW", torch.optim.AdamW, ("exp_avg", "exp_avg_sq"), True,
                                     _ADAM_HYPER, ("amsgrad", "maximize")),
    torch.optim.Adam: OptimizerKind("Adam", torch.optim.Adam, ("exp_avg", "exp_avg_sq"), True,
                                    _ADAM_HYPER, ("amsgrad", "maximize", "decoupled_weight_decay")),
    torch.optim.SGD: OptimizerKind("SGD", torch.optim.SGD, ("momentum_buffer",), False,
                                   ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
                                   ("maximize",)),
    Lion: OptimizerKind("Lion", Lion, ("exp_avg",), False, ("lr", "betas", "weight_decay"), ()),
    Lamb: OptimizerKind("Lamb", Lamb, ("exp_avg", "exp_avg_sq"), True,
                        (*_ADAM_HYPER, "bias_correction", "max_coeff", "min_coeff"), (),
                        whole_norms=True),
    OneBitAdam: OptimizerKind("OneBitAdam", OneBitAdam, ("exp_avg", "exp_avg_sq"), True,
                              (*_ADAM_HYPER, "bias_correction"), ()),
    ZeroOneAdam: OptimizerKind("ZeroOneAdam", ZeroOneAdam, ("exp_avg", "exp_avg_sq"), True,
                               (*_ADAM_HYPER, "bias_correction"), ()),
    OneBitLamb: OptimizerKind("OneBitLamb", OneBitLamb,
                              ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"), True,
                              (*_ADAM_HYPER, "bias_correction", "max_coeff", "min_coeff"), ()),
}
#: What a checkpoint that records no optimizer holds (those were all written by Adam/AdamW).
LEGACY_STATE = ("exp_avg", "exp_avg_sq")


def kind_of(optimizer: torch.optim.Optimizer | type) -> OptimizerKind:
    """The kind of ``optimizer`` (an instance or a class); ConfigError for any other."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    kind = KINDS.get(cls)
    if kind is None:
        names = ", ".join(f"torch.optim.{k.__name__}" for k in KINDS)
        raise ConfigError(f"optimizer {cls.__name__} cannot run on megazero's ZeRO fp32 master "
                          f"shards; use one of {names} (or the \"optimizer\" block: Adam, AdamW, "
                          "SGD, Lion, Lamb, OneBitAdam, ZeroOneAdam or OneBitLamb)")
    if not isinstance(optimizer, type):
        for g in optimizer.param_groups:
            on = [k for k in kind.unsupported if g.get(k)]
            if on:
                raise ConfigError(f"{cls.__name__}({on[0]}=True) is not supported on megazero's "
                                  f"ZeRO shards; leave {on[0]} False")
    return kind


def config_class(cfg: OptimizerConfig) -> type[torch.optim.Optimizer]:
    """``adam``: Adam with L2 weight decay (added to the gradient, DeepSpeed's ``adam_w_mode:
    false``); ``adamw``: decoupled weight decay; ``sgd``: SGD (momentum, Nesterov, dampening;
    L2 weight decay); ``lion``: :class:`megazero.zero.lion.Lion` (decoupled weight decay);
    ``lamb``: :class:`megazero.optim.lamb.Lamb` (DeepSpeed's rule and parameters)."""
    classes: dict[str, type[torch.optim.Optimizer]] = {
        "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
        "lion": Lion, "lamb": Lamb, "onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam,
        "onebitlamb": OneBitLamb}
    if cfg.optimizer not in classes:
        raise ConfigError(f"optimizer {cfg.optimizer!r} is not supported; use adam, adamw, sgd, "
                          "lion, lamb, onebitadam, zerooneadam or onebitlamb")
    return classes[cfg.optimizer]


def config_defaults(cfg: OptimizerConfig) -> dict[str, Any]:
    """The group settings an :class:`OptimizerConfig` gives its optimizer."""
    if cfg.optimizer == "sgd":
        return {"lr": cfg.lr, "momentum": cfg.sgd_momentum, "dampening": cfg.sgd_dampening,
                "weight_decay": cfg.weight_decay, "nesterov": cfg.sgd_nesterov}
    if cfg.optimizer == "lion":
        return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2),
                "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "lamb":
        return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay, "bias_correction": cfg.bias_correction,
                "max_coeff": cfg.lamb_max_coeff, "min_coeff": cfg.lamb_min_coeff}
    if cfg.optimizer == "onebitadam":
        return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay, "bias_correction": cfg.bias_correction,
                "freeze_step": cfg.freeze_step, "cuda_aware": cfg.cuda_aware,
                "comm_backend_name": cfg.comm_backend_name}
    if cfg.optimizer == "onebitlamb":
        return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay, "bias_correction": cfg.bias_correction,
                "freeze_step": cfg.freeze_step, "max_coeff": cfg.lamb_max_coeff,
                "min_coeff": cfg.lamb_min_coeff, "coeff_beta": cfg.coeff_beta,
                "factor_max": cfg.factor_max, "factor_min": cfg.factor_min,
                "factor_threshold": cfg.factor_threshold, "cuda_aware": cfg.cuda_aware,
                "comm_backend_name": cfg.comm_backend_name}
    if cfg.optimizer == "zerooneadam":
        return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay, "bias_correction": cfg.bias_correction,
                "var_freeze_step": cfg.var_freeze_step,
                "var_update_scaler": cfg.var_update_scaler,
                "local_step_scaler": cfg.local_step_scaler,
                "local_step_clipper": cfg.local_step_clipper, "cuda_aware": cfg.cuda_aware,
                "comm_backend_name": cfg.comm_backend_name}
    return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
            "weight_decay": cfg.weight_decay}


def state_layout(cfg: OptimizerConfig) -> tuple[int, bool]:
    """(fp32 state tensors per master element, whether a ``step`` scalar is kept per piece)
    once the optimizer ``cfg`` names has stepped: what the memory planner counts."""
    kind = KINDS[config_class(cfg)]
    tensors = 0 if cfg.optimizer == "sgd" and cfg.sgd_momentum == 0 else len(kind.state)
    return tensors, kind.has_step


#: Optimizers whose update runs as torch's fused CPU kernel when their masters are on the host.
FUSED_ON_CPU: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
#: Optimizers whose update runs as torch's fused CUDA kernel when their masters are on a GPU
#: (Megatron's and PyTorch's choice for Adam on GPUs).
FUSED_ON_CUDA: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def update_kernel(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> str:
    """``"fused"`` where every master is a CPU tensor and ``cls`` is in :data:`FUSED_ON_CPU`,
    or every master is a CUDA tensor and ``cls`` is in :data:`FUSED_ON_CUDA`; else
    ``"foreach"``.

    Why: torch's foreach Adam makes one pass over memory per elementwise op and allocates fp32
    temporaries the size of the sub-group (on the host, a page-faulting allocation each step);
    the fused kernels read p, grad, exp_avg, exp_avg_sq once, with no temporaries (on CUDA one
    launch per group instead of one per op). The kernels differ in rounding by a few ulps, so
    the choice depends only on where the masters are: CPU offload, NVMe offload and a CPU-only
    run all use the same kernel and train bitwise alike, and so do all GPU runs."""
    params = [p for g in groups for p in g["params"]]
    if not params:
        return "foreach"
    kinds = {p.device.type for p in params}
    if kinds == {"cpu"} and cls in FUSED_ON_CPU:
        return "fused"
    if kinds == {"cuda"} and cls in FUSED_ON_CUDA:
        return "fused"
    return "foreach"


def place_step(value: torch.Tensor, master: torch.Tensor,
               group: dict[str, Any]) -> torch.Tensor:
    """A loaded per-parameter ``step`` counter, placed where torch's optimizer keeps it: on the
    master's device for the fused and capturable kernels (the fused CUDA kernel reads it there
    and refuses a host tensor), on the host otherwise; fp32, a copy. The same policy as torch's
    own ``Optimizer.load_state_dict``."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    device = master.device if on_device else torch.device("cpu")
    return value.detach().to(dtype=torch.float32, device=device).clone()


def class_factory(cls: type[torch.optim.Optimizer], **defaults: Any) -> OptimizerFactory:
    """``groups -> cls(groups, **defaults)`` with the update kernel :func:`update_kernel`
    picks; a torch (or device) without that fused kernel falls back to the foreach one."""
    kind_of(cls)

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        if update_kernel(cls, groups) == "fused":
            try:
                return cls(groups, **{"fused": True, **defaults})
            except (RuntimeError, TypeError):  # a torch without the fused kernel here
                pass
        return cls(groups, **{"foreach": True, **defaults})

    return make


def config_factory(cfg: OptimizerConfig) -> OptimizerFactory:
    return class_factory(config_class(cfg), **config_defaults(cfg))


def decay_groups(params: Iterable[nn.Parameter], ndims: dict[int, int] | None = None,
                 decoupled: bool = False) -> list[dict[str, Any]]:
    """Megatron's convention: weight decay on matrices, none on biases and norm weights
    (``ndim < 2``). ``ndims`` overrides a parameter's own rank (stage 3 releases parameters
    to empty tensors). ``decoupled`` (Megatron's ``--decoupled-lr``): the input embedding and
    the output layer (parameters flagged ``embedding_or_output``) form a third group, marked
    ``decoupled`` for the learning-rate scheduler."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    own: list[nn.Parameter] = []
    for p in params:
        ndim = (ndims or {}).get(id(p), p.ndim)
        if decoupled and getattr(p, "embedding_or_output", False):
            own.append(p)
        else:
            (decay if ndim >= 2 else no_decay).append(p)
    groups: list[dict[str, Any]] = [
        {"params": decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    if decoupled:
        groups.append({"params": own, "name": "decoupled", "decoupled": True})
    return groups
