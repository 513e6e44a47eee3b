"""What ``tools/plan_layout.py`` says about the layouts it found: why each loses to the winner,
why the winner beats the runner-up, the batch it assumed, and the winner as flags and a
DeepSpeed JSON."""

from __future__ import annotations

import json
from typing import Any

from megazero.planner.candidate import Candidate


def why_slower(c: Candidate, winner: Candidate) -> str:
    """The time terms where ``c`` loses most to the winner."""
    a, b = c.est.time.terms, winner.est.time.terms
    diffs = sorted(((a.get(k, 0) - b.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
    parts = [f"+{d:.3g}s {k}" for d, k in diffs[:2] if d > 0]
    return ", ".join(parts) or "same predicted time"


def runner_up(ranked: list[Candidate]) -> tuple[Candidate | None, list[Candidate]]:
    """(the first candidate predicted slower than the winner, those tied with the winner: the
    same predicted time, e.g. ZeRO stages 1 and 2 when gradients are reduced once a step)."""
    win = ranked[0].est.time.seconds
    ties = []
    for c in ranked[1:]:
        if c.est.time.seconds > win * (1 + 1e-9):
            return c, ties
        ties.append(c)
    return None, ties


def why_winner(winner: Candidate, runner_up: Candidate) -> str:
    """One line: by how much the winner beats the runner-up and in which time terms (what it
    saves, and what it pays for that), with the throughput of both."""
    a, b = winner.est.time, runner_up.est.time
    diffs = sorted(((b.terms.get(k, 0.0) - a.terms.get(k, 0.0), k)
                    for k in set(a.terms) | set(b.terms)), reverse=True)
    saves = [f"{d:.3g} s {k}" for d, k in diffs if d > 1e-9]
    pays = [f"{-d:.3g} s {k}" for d, k in diffs if d < -1e-9]
    gap = b.seconds - a.seconds
    line = (f"beats the runner-up ({runner_up.label}) by {gap:.3g} s per iteration "
            f"({gap / b.seconds:.1%}; {a.tokens_per_s:,.0f} vs {b.tokens_per_s:,.0f} tokens/s)")
    if saves:
        line += ": it saves " + ", ".join(saves)
    if pays:
        line += "; it pays " + ", ".join(pays)
    return line


def deepspeed_json(c: Candidate) -> dict[str, Any]:
    cfg = c.est.config
    t, z = cfg.train, cfg.zero
    dp = cfg.layout().dp
    gbs = t.global_batch_size or t.micro_batch_size * dp
    ds: dict[str, Any] = {
        "train_batch_size": gbs, "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gbs // (t.micro_batch_size * dp),
        "zero_optimization": {"stage": z.stage, "overlap_comm": z.overlap_comm,
                              "contiguous_gradients": True},
        "gradient_clipping": cfg.optimizer.clip_grad,
    }
    if z.offload_optimizer.enabled:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.precision.bf16:
        ds["bf16"] = {"enabled": True}
    if cfg.precision.fp16:
        ds["fp16"] = {"enabled": True, "loss_scale": 0}
    return ds


def winner_flags(c: Candidate, base: list[str]) -> str:
    """The winner's command line. ``--vocab-size`` (from a model preset) only sizes synthetic
    data; with a real corpus the tokenizer decides the vocabulary, so it is left out unless
    the run uses ``--mock-data`` or the NullTokenizer."""
    flags = [f for f in c.flags if f != "--offload-optimizer" and not f.startswith("--zero-")]
    synthetic = "--mock-data" in base or "NullTokenizer" in base
    kept: list[str] = []
    skip = False
    for i, f in enumerate(base):
        if skip:
            skip = False
            continue
        if f.split("=")[0] == "--vocab-size" and not synthetic:
            skip = "=" not in f and i + 1 < len(base)
            continue
        kept.append(f)
    return " ".join(kept + flags + ["--deepspeed_config", "ds_config.json"])


def assumptions(cfg: Any, gbs_note: str = "") -> str:
    """The batch and sequence a prediction is for, in one line."""
    t, m = cfg.train, cfg.model
    dp = cfg.layout().dp
    gbs = t.global_batch_size or t.micro_batch_size * dp
    return (f"assuming sequence length {m.seq_length}, micro-batch {t.micro_batch_size}, "
            f"global batch {gbs}{gbs_note} ({gbs // (t.micro_batch_size * dp)} "
            f"micro-batch(es) per iteration at dp {dp}), vocabulary {m.vocab_size}, overlap_comm "
            f"{str(cfg.zero.overlap_comm).lower()}")


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2)
