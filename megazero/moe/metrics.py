"""What users watch of the routers, per logged iteration (Megatron's ``track_moe_metrics``).

Each router accumulates, over the training forwards of a log interval (recomputed forwards
excluded: they run with gradients only once), its balancing loss (unscaled: 1.0 at perfect
balance), its z-loss (unscaled), the tokens routed before dropping and the tokens each expert
took. :func:`collect` sums these over every rank with one all-reduce (the counts are already
summed over the TP x CP group, so only its first rank contributes) and turns them into scalars:

- ``load_balancing_loss``, ``z_loss``: mean over micro-batches, replicas and MoE layers
  (Megatron's names, its log line and TensorBoard tags);
- ``moe/tokens_per_expert_min`` / ``_max``: tokens an expert took per iteration (whole global
  batch), the least and most loaded expert of any layer;
- ``moe/dropped_token_fraction``: routed tokens over capacity, dropped;
- with ``--moe-per-layer-logging`` each of them per layer, ``moe/<name>_layer_<L>``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megazero.distributed.topology import ParallelTopology
from megazero.moe.router import TopKRouter, routers

#: columns of a router's accumulator before its per-expert counts
LB, Z, MICRO, ROUTED, COUNTS = 0, 1, 2, 3, 4


def collect(chunks: list[nn.Module], topo: ParallelTopology, num_layers: int,
            num_experts: int, iterations: int, per_layer: bool = False) -> dict[str, float]:
    """The interval's MoE scalars (see the module docstring); resets the accumulators.
    Collective over the whole world: every rank calls it at every logged iteration."""
    mine = routers(chunks)
    device = mine[0].weight.device if mine else torch.device("cpu")
    table = torch.zeros(num_layers, COUNTS + num_experts, dtype=torch.float64, device=device)
    for r in mine:
        if topo.tp_rank == 0 and topo.cp_rank == 0:
            table[r.layer_number] += r.metrics_acc.to(device, torch.float64)
        r.metrics_acc.zero_()
    if dist.is_available() and dist.is_initialized() and topo.world_size > 1:
        dist.all_reduce(table)
    table = table.cpu()
    rows = [i for i in range(num_layers) if table[i, MICRO] > 0]
    if not rows:
        return {}
    per: dict[int, dict[str, float]] = {}
    for i in rows:
        row = table[i]
        counts = row[COUNTS:] / max(iterations, 1)
        routed = float(row[ROUTED])
        per[i] = {"load_balancing_loss": float(row[LB] / row[MICRO]),
                  "z_loss": float(row[Z] / row[MICRO]),
                  "moe/tokens_per_expert_min": float(counts.min()),
                  "moe/tokens_per_expert_max": float(counts.max()),
                  "moe/dropped_token_fraction":
                      1.0 - float(row[COUNTS:].sum()) / routed if routed else 0.0}
    out = {"load_balancing_loss": sum(p["load_balancing_loss"] for p in per.values()) / len(per),
           "z_loss": sum(p["z_loss"] for p in per.values()) / len(per),
           "moe/tokens_per_expert_min": min(p["moe/tokens_per_expert_min"] for p in per.values()),
           "moe/tokens_per_expert_max": max(p["moe/tokens_per_expert_max"] for p in per.values()),
           "moe/dropped_token_fraction": 1.0 - float(table[rows, COUNTS:].sum())
           / max(float(table[rows, ROUTED].sum()), 1.0)}
    if per_layer:
        for i, p in per.items():
            for name, value in p.items():
                base = name.removeprefix("moe/")
                out[f"moe/{base}_layer_{i}"] = value
    return out


def log_line_part(scalars: dict[str, float]) -> str:
    """The MoE fields of the log line (empty without MoE scalars)."""
    if not scalars:
        return ""
    return (f" load_balancing_loss: {scalars['load_balancing_loss']:.6E} |"
            f" z_loss: {scalars['z_loss']:.6E} |"
            f" tokens per expert min/max: {scalars['moe/tokens_per_expert_min']:.1f}/"
            f"{scalars['moe/tokens_per_expert_max']:.1f} |"
            f" dropped tokens: {100.0 * scalars['moe/dropped_token_fraction']:.2f}% |")


__all__ = ["TopKRouter", "collect", "log_line_part"]
