"""Move a global model state (tp=1 names, full unpadded tensors) into and out of model chunks.

A chunk of any layout takes from the global state the tensors its parameters are slices of:
vocab padding is added and the TP slice cut by
:func:`megazero.tensor_parallel.layers.load_full_into_shard`; the tied output layer of the last
pipeline stage (``init_name``) reads the word embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from megazero.tensor_parallel.layers import load_full_into_shard
from megazero.tensor_parallel.utils import full_model_state_dict

if TYPE_CHECKING:
    from megazero.distributed.topology import ParallelTopology


def load_global_state(model: nn.Module, state: Mapping[str, torch.Tensor],
                      topo: ParallelTopology) -> None:
    """Fill every parameter of ``model`` (one chunk) from ``state``; a missing tensor or a
    shape mismatch is an error naming the parameter."""
    for name, p in model.named_parameters():
        key = getattr(p, "init_name", name)
        if key not in state:
            raise KeyError(f"global state has no tensor {key!r} for parameter {name!r}")
        full = state[key].to(p.dtype)
        want = getattr(p, "vocab_size", None)
        if want is not None and full.shape[0] != want:
            raise ValueError(f"{key}: {full.shape[0]} vocabulary rows, the model has {want}")
        load_full_into_shard(p, full, topo.tp_group)


def model_global_state(model: nn.Module, topo: ParallelTopology) -> dict[str, torch.Tensor]:
    """The global state of a tp=1 (or TP-sharded, collective) whole model: unpadded, fp32."""
    return {k: v.float() for k, v in full_model_state_dict(model, topo).items()}
