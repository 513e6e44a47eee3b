"""Parameters created on the rank's device, one at a time, from a model built on the meta device.

Why: built on the host and then moved, a model occupies its whole shard of host memory first
(52 GB per rank for a 13B model at tp 1; eight ranks share a node's memory). Here every
parameter is allocated directly on ``device`` and filled in place, chunk by chunk, by the
layout-independent generator of :mod:`megazero.model.init`: the values are drawn and rounded to
fp32 on the host (so they are bit for bit what a host build gives, at every layout) in chunks
of ``CHUNK_ELEMENTS``, each copied to the device before the next is drawn. The host never holds
more than the generator's scratch buffers; the device holds the final weights and nothing else.

The parameter objects are kept (their contents are swapped, ``torch.utils.swap_tensors``), so
their attributes (tensor-parallel partitioning, init rules, sharing marks) and every module
that holds them stay as they were.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.model.init import init_parameter_, spec_of, workspace


@torch.no_grad()
def materialize_parameters(model: nn.Module, device: torch.device, seed: int,
                           tp_rank: int = 0, tp_size: int = 1) -> None:
    """Allocate each meta parameter of ``model`` on ``device`` and fill it with its slice of
    the seeded full tensor (``model.config`` holds the init std), one parameter at a time.
    Parameters already materialised are left alone."""
    config = model.config
    with workspace():
        for name, p in model.named_parameters():
            if not p.is_meta:
                continue
            spec = spec_of(p, name)
            new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                               requires_grad=p.requires_grad)
            init_parameter_(p, spec, config, seed, tp_rank, tp_size, out=new.data)
            new.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(p, new)
