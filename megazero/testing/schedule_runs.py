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


def merge_ranks(ranks: list[list[dict]]) -> list[dict]:
    """Per case of :func:`runs_world`: rank 0's losses and norms, every rank's weights."""
    out = []
    for i, first in enumerate(ranks[0]):
        weights: dict[str, Any] = {}
        for r in ranks:
            weights.update(r[i]["weights"])
        out.append({**first, "weights": weights})
    return out


def assert_same_run(got: dict, ref: dict, what: str, weights: bool = True,
                    subset: bool = False) -> None:
    """``got`` trained ``ref``'s model: losses to 2e-6 and grad norms to 2e-5 relative, every
    weight (those ``got`` has, with ``subset``) to 2e-5 of its largest entry plus 3e-6 (only
    the order of sums differs; a wrong gradient moves a weight by a whole Adam step)."""
    assert len(got["losses"]) == len(ref["losses"]) > 0, what
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 2e-6 * abs(b), f"{what}: loss {a} vs {b}"
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= 2e-5 * abs(b), f"{what}: grad norm {a} vs {b}"
    if not weights:
        return
    if not subset:
        assert got["weights"].keys() == ref["weights"].keys(), what
    assert got["weights"], what
    for k, w in got["weights"].items():
        r = ref["weights"][k]
        err = float(abs(w - r).max())
        assert err <= 2e-5 * float(abs(r).max()) + 3e-6, f"{what}: {k} off by {err}"
