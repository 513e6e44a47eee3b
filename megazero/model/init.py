"""Layout-independent parameter initialisation.

Every parameter's full (tp=1, unpadded) master tensor is drawn on CPU in fp32 from its own
generator, seeded by ``(seed, global parameter name)``; each TP rank then keeps its slice. The
global name uses global layer indices, so layer 5 is the same tensor whether it lives in the
full model or in pipeline chunk ``[4, 8)``, and a tp=4 model holds bitwise the slices of the
tp=1 model. Generating full tensors on every rank costs CPU time at start-up only.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn

from megazero.config import ModelConfig
from megazero.tensor_parallel.layers import load_full_into_shard

_SCALED = (".linear_proj.weight", ".linear_fc2.weight")
_NORM_PARTS = ("layernorm.", "norm.")


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "vocab_size", None) is not None:
        shape[0] = param.vocab_size
    elif getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def full_init_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int
                     ) -> torch.Tensor:
    """The full master tensor of parameter ``name``: ones/zeros for norms, zeros for biases,
    N(0, std) for weights, N(0, std/sqrt(2L)) for output projections (Megatron's scaled init).
    """
    leaf = name.rsplit(".", 1)[-1]
    is_norm = any(part in name for part in _NORM_PARTS)
    if is_norm:
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = config.init_method_std
    if name.endswith(_SCALED):
        std = std / math.sqrt(2.0 * config.num_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def initialize_parameters(model: nn.Module, config: ModelConfig, topo: Any, seed: int) -> None:
    """Fill every parameter of ``model`` with its slice of the seeded full tensor.

    A parameter may carry ``init_name`` to be initialised as another one (the output-layer
    copy of a tied word embedding on the last pipeline stage).
    """
    for name, p in model.named_parameters():
        init_name = getattr(p, "init_name", name)
        full = full_init_tensor(init_name, full_shape(p, topo.tp_size), config, seed)
        load_full_into_shard(p, full, topo.tp_group)
