"""Enumerate the layouts a run could use, keep those that fit, rank them by predicted time.

A layout is (tp, pp, layers per virtual stage, ZeRO stage, optimizer offload, recompute, SP,
micro-batch size); each candidate becomes pretrain_gpt.py flags and goes through
``load_config`` so that only layouts the run would accept are kept. Memory is evaluated on the
first and last pipeline stages (the first holds the most in-flight activations, the last the
logits; middle stages hold less of both).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from megazero.config import ConfigError, load_config, valid_microbatch_group_sizes
from megazero.config.rules import divisors, sequence_parallel_active
from megazero.planner.cluster import Cluster, planning_argv
from megazero.planner.estimate import Estimate, estimate


@dataclass
class Candidate:
    flags: list[str]
    est: Estimate

    @property
    def label(self) -> str:
        c = self.est.config
        p, z = c.parallel, c.zero
        rc = p.recompute.granularity or "none"
        off = "+off" if z.offload_optimizer.enabled else ""
        return (f"tp{p.tp} pp{p.pp} vpp{c.vpp or 1} dp{c.layout().dp} z{z.stage}{off} "
                f"rc={rc} sp={'on' if p.sequence_parallel else 'off'} "
                f"mbs={c.train.micro_batch_size}")


def candidate_flags(num_layers: int, world: int, gpus_per_node: int, gbs: int,
                    max_pp: int = 64, stages: tuple[int, ...] = (0, 1, 2, 3)
                    ) -> list[list[str]]:
    out = []
    for tp in [d for d in divisors(gpus_per_node) if world % d == 0]:
        for pp in [d for d in divisors(num_layers) if world % (tp * d) == 0 and d <= max_pp]:
            dp = world // (tp * pp)
            per_stage = num_layers // pp
            vpps = [None] + ([k for k in divisors(per_stage) if 2 <= per_stage // k <= 4]
                             if pp > 1 else [])
            for mbs in (1, 2, 4, 8):
                if gbs % (mbs * dp):
                    continue
                m = gbs // (mbs * dp)
                for vl, stage, off, rc, sp in itertools.product(
                        vpps, stages, (False, True), ("none", "selective", "full"),
                        (False, True)):
                    if (sp and not sequence_parallel_active(sp, tp)) or (off and stage == 0):
                        continue
                    if vl is not None and pp not in valid_microbatch_group_sizes(pp, m):
                        continue
                    f = [f"--tensor-model-parallel-size={tp}",
                         f"--pipeline-model-parallel-size={pp}", f"--zero-stage={stage}",
                         f"--micro-batch-size={mbs}", f"--global-batch-size={gbs}"]
                    if vl is not None:
                        f.append(f"--num-layers-per-virtual-pipeline-stage={vl}")
                    if rc == "selective":
                        f.append("--recompute-granularity=selective")
                    elif rc == "full":
                        f += ["--recompute-granularity=full", "--recompute-method=uniform",
                              "--recompute-num-layers=1"]
                    if sp:
                        f.append("--sequence-parallel")
                    if off:
                        f.append("--offload-optimizer")  # planner-only marker, see _config
                    out.append(f)
    return out


def _config(base: list[str], flags: list[str], world: int, cluster: Cluster | None = None):
    from dataclasses import replace

    from megazero.config import OffloadConfig

    off = "--offload-optimizer" in flags
    argv = planning_argv(base, cluster) if cluster is not None else base
    cfg = load_config(argv + [f for f in flags if f != "--offload-optimizer"], world)
    # the user's overlap_comm (flags or JSON), as estimate_memory.py reads it: one step-time
    # model for both tools; the DeepSpeed JSON written for the winner says the same
    zero = cfg.zero
    if off:
        zero = replace(zero, offload_optimizer=OffloadConfig(device="cpu"))
    return replace(cfg, zero=zero)


def search(base: list[str], world: int, cluster: Cluster, gbs: int,
           stages: tuple[int, ...] = (0, 1, 2, 3)) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting candidates by predicted time, all evaluated candidates)."""
    num_layers = load_config(base, world).model.num_layers
    evaluated = []
    for flags in candidate_flags(num_layers, world, cluster.gpus_per_node, gbs, stages=stages):
        try:
            cfg = _config(base, flags, world, cluster)
            pp = cfg.parallel.pp
            est = estimate(cfg, cluster, stages=sorted({0, pp - 1}))
        except ConfigError:
            continue
        evaluated.append(Candidate(flags, est))
    fits = sorted((c for c in evaluated if c.est.fits), key=lambda c: c.est.time.seconds)
    return fits, evaluated


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
