"""Training runs at several pipeline schedules in one spawned world, for the zero-bubble
equivalence tests: each run's losses, grad norms and reassembled weights."""

from __future__ import annotations

import os
from typing import Any


def runs_world(rank: int, world: int, cases: list[list[str]]) -> list[dict]:
    """Set up and train every case (its full argument list, as ``pretrain_gpt.py`` takes it)
    in turn; per case, this rank's ``{"losses", "norms", "weights"}`` (weights: the full
    tensors of this rank's chunks, its local experts at expert parallel, from TP rank 0; none
    at ZeRO 3, whose parameters are partitioned)."""
    from megazero.config import load_config
    from megazero.tensor_parallel import full_model_state_dict
    from megazero.training.lifecycle import setup
    from megazero.training.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    out = []
    for args in cases:
        cfg = load_config(args, world)
        run = setup(cfg)
        try:
            state = train(run)
            weights: dict[str, Any] = {}
            if cfg.zero.stage < 3:
                for chunk in run.chunks:
                    full = full_model_state_dict(chunk, run.topo)
                    if run.topo.tp_rank == 0:  # experts differ across data-parallel ranks
                        # numpy: a tensor would travel back as a shared-memory handle
                        weights.update({k: v.float().numpy().copy() for k, v in full.items()})
        finally:
            run.close()
        out.append({"losses": [h["loss"] for h in state.history],
                    "norms": [h["grad_norm"] for h in state.history], "weights": weights})
    return out
