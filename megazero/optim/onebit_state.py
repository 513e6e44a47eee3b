"""The 1-bit optimizers' per-rank state (error-feedback buffers and the like) in checkpoints.

The moments (``exp_avg``, ``exp_avg_sq``, ``step``) are saved per parameter like Adam's, in the
layout-free tensors every checkpoint holds. The worker and server errors are not: each data-
parallel rank holds its own, and their shapes follow the dp size (the worker error is the
parameter padded to a multiple of 8 x dp elements, the server error one dp-th of that). They go
into each rank's ``optim_rng.pt`` keyed by the parameter's global name and the piece's offset,
and load back at the same tp, pp and dp; at another layout the load stops and says so,
offering ``--no-load-optim`` (weights only). A OneBitAdam checkpoint written before
``freeze_step`` has no per-rank state and loads at any layout; ZeroOneAdam and OneBitLamb keep
theirs (error buffers, 0/1 Adam's accumulator, 1-bit Lamb's averaged trust ratio) from the
first step.
"""

from __future__ import annotations

from typing import Any

import torch

from megazero.errors import CheckpointError

ErrorState = dict[str, list[tuple[int, dict[str, torch.Tensor]]]]


def _onebit(engine: Any) -> Any:
    opt = getattr(getattr(engine, "masters", None), "optimizer", None)
    return opt if hasattr(opt, "rank_state") and hasattr(opt, "compress") else None


def error_feedback_state(engine: Any, infos: list[Any]) -> ErrorState | None:
    """This rank's error buffers: {global name: [(piece offset, worker, server)]}; None for
    another optimizer or before the compressed phase."""
    opt = _onebit(engine)
    if opt is None:
        return None
    names = {id(i.param): i.name for i in infos}
    out: ErrorState = {}
    for pc in engine.masters.pieces:
        st = opt.state.get(pc.master, {})
        if any(k in st for k in opt.rank_state) and id(pc.param) in names:
            out.setdefault(names[id(pc.param)], []).append(
                (pc.offset, {k: st[k].detach().cpu().clone() for k in opt.rank_state
                             if k in st}))
    return out or None


def check_error_feedback(saved: ErrorState | None, saved_layout: dict[str, int],
                         layout: dict[str, int], directory: str) -> None:
    """Refuse, in one line, per-rank state saved at another tp, pp or dp."""
    def name(lay: dict[str, int]) -> str:
        return " ".join(f"{k} {lay[k]}" for k in ("tp", "pp", "dp"))

    if saved and any(saved_layout[k] != layout[k] for k in ("tp", "pp", "dp")):
        raise CheckpointError(f"checkpoint {directory} holds a 1-bit optimizer's per-rank "
                              f"state (error-feedback buffers, each rank's own and shaped by "
                              f"the dp size) for {name(saved_layout)}; this run is "
                              f"{name(layout)}: resume at the saved layout, or load the "
                              "weights alone with --no-load-optim (the moments restart)")


def load_error_feedback(engine: Any, infos: list[Any], saved: ErrorState | None) -> None:
    """Put this rank's saved error buffers back (same layout) and set the engine's gradient
    reduction for the loaded step (local once the warm-up is over)."""
    opt = _onebit(engine)
    if opt is None:
        return
    names = {id(i.param): i.name for i in infos}
    by_key = {(name, off): tensors for name, parts in (saved or {}).items()
              for off, tensors in parts}
    for pc in engine.masters.pieces:
        st = opt.state.get(pc.master)
        got = by_key.get((names.get(id(pc.param), ""), pc.offset))
        if st is not None and got is not None:
            for k, t in got.items():
                st[k] = t.to(pc.master.device) if t.dim() else t.clone()
    opt.sync_phase()
