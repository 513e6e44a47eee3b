"""The engine's optimizer and learning-rate schedule, from the JSON blocks or the caller's own.

The ZeRO optimizer (:func:`megazero.zero.build_zero_optimizer`) keeps fp32 master shards and
runs a stock torch optimizer on them, built by a factory over the caller's param groups. A
DeepSpeed user's config applies the optimizer's settings to exactly the parameter groups passed
in (``model_parameters``, or the client optimizer's ``param_groups``); each shard piece gets its
parameter's group settings.

The optimizers that run on the shards are those of :data:`megazero.zero.optimizers.KINDS`
(Adam, AdamW, SGD): their per-parameter state is what the portable checkpoint stores; any other
client optimizer is rejected with a message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megazero.config import ConfigError, MegazeroConfig
from megazero.engine.config import has_optimizer_block, has_scheduler_block
from megazero.optim.lr_scheduler import LRScheduler, build_lr_function
from megazero.zero import ZeroOptimizer, build_zero_optimizer
from megazero.zero.optimizers import class_factory, config_class, config_defaults, kind_of

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


def _groups_from(params: Any, defaults: dict[str, Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**defaults, **{k: v for k, v in g.items() if k != "params"},
                 "params": list(g["params"])} for g in items]
    return [{**defaults, "params": items}]


def _client_groups(client: torch.optim.Optimizer) -> tuple[type, list[dict[str, Any]]]:
    kind = kind_of(client)
    groups = [{**{k: g[k] for k in kind.hyper}, "params": list(g["params"])}
              for g in client.param_groups]
    return kind.cls, groups


def _check_coverage(module: nn.Module, groups: list[dict[str, Any]]) -> None:
    listed = {id(p) for g in groups for p in g["params"]}
    named = {id(p): n for n, p in module.named_parameters()}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in listed]
    if missing:
        raise ConfigError(f"model_parameters / the optimizer's groups omit {len(missing)} "
                          f"trainable parameter(s) of the model (first: {missing[0]!r}); pass "
                          "model.parameters(), or set requires_grad=False on frozen ones")
    foreign = [p for g in groups for p in g["params"] if id(p) not in named]
    if foreign:
        raise ConfigError(f"{len(foreign)} parameter(s) given to the optimizer are not "
                          "parameters of model=; pass the model's own parameters")


def build_optimizer(module: nn.Module, cfg: MegazeroConfig, topo: ParallelTopology, client: Any,
                    model_parameters: Any, param_init: Any = None) -> tuple[ZeroOptimizer, Any]:
    """The ZeRO optimizer over ``module`` and the client optimizer it was built from (or None).
    ``param_init``: ``module`` is on the meta device (see ``build_zero_optimizer``)."""
    if callable(client) and not isinstance(client, torch.optim.Optimizer):
        params = model_parameters if model_parameters is not None else module.parameters()
        client = client(params)
    if client is not None and has_optimizer_block(cfg):
        raise ConfigError("an optimizer is given twice: optimizer= to megazero.initialize and "
                          "an \"optimizer\" block in the config; keep one of them")
    o = cfg.optimizer
    if client is not None:
        cls, groups = _client_groups(client)
    elif has_optimizer_block(cfg):
        cls, defaults = config_class(o), config_defaults(o)
        groups = _groups_from(model_parameters if model_parameters is not None
                              else module.parameters(), defaults)
    else:
        raise ConfigError("no optimizer: add an \"optimizer\" block to the config (e.g. "
                          "{\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass "
                          "optimizer= to megazero.initialize")
    groups = [g for g in groups if g["params"]]
    _check_coverage(module, groups)
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    for g in groups:
        g["params"] = [p for p in g["params"] if id(p) in trainable]
    zero = build_zero_optimizer(module, o, cfg.zero, cfg.precision, topo,
                                optimizer_factory=class_factory(cls), param_groups=groups,
                                param_init=param_init)
    return zero, client


def build_scheduler(cfg: MegazeroConfig, zero: ZeroOptimizer, client_scheduler: Any) -> Any:
    """The schedule from the JSON ``scheduler`` block, or the caller's (an object, or a
    callable taking the torch optimizer that runs on the master shards), or None."""
    if client_scheduler is not None and has_scheduler_block(cfg):
        raise ConfigError("a learning-rate scheduler is given twice: lr_scheduler= to "
                          "megazero.initialize and a \"scheduler\" block in the config; keep "
                          "one of them")
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(zero.masters.optimizer)
        return client_scheduler
    if has_scheduler_block(cfg):
        return LRScheduler(zero, build_lr_function(cfg.optimizer, None))
    return None
