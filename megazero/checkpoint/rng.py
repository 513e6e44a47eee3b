"""Every random stream a step may draw from, as tensors and plain lists, so checkpoints load
with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state(tracker: Any = None) -> dict[str, Any]:
    """Every random stream a step may draw from, as tensors and plain lists (weights_only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)],
        "random": [version, list(internal), gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict[str, Any], tracker: Any = None) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and "tracker" in state:
        tracker.set_states(state["tracker"])
