"""Guards for torch APIs newer than the oldest supported torch (``setup.py``; CI runs the core of
the suite on it).

Each name here resolves once, at import, to the newest implementation the installed torch has,
with a fallback that computes the same thing. Code elsewhere calls these instead of probing
``torch.distributed`` itself, so the version rule lives in one place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# ``all_gather_single`` / ``reduce_scatter_single`` are the recent names of the single-tensor
# collectives; ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` exist since torch 2.0.
all_gather_into_tensor: Any = (getattr(dist, "all_gather_single", None)
                               or dist.all_gather_into_tensor)
reduce_scatter_tensor: Any = (getattr(dist, "reduce_scatter_single", None)
                              or dist.reduce_scatter_tensor)

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

