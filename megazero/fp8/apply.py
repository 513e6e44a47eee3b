"""Put FP8 GEMMs into a model's linears: a transform applied once the chunks are built.

Every column- and row-parallel linear of a transformer layer (QKV, attention output, MLP in
and out, shared experts) and the experts of an MoE layer get an :class:`FP8Gemm` that knows how
its operands lie over the ranks; the embedding, output layer, router, norms and attention are
left alone, and so are the layers ``--first-last-layers-bf16`` keeps in bf16.

Which group a whole-tensor amax is reduced over follows from where each operand is split:

=================  ==========================  ==========================  ================
linear             input ``x``                 weight                      grad ``dy``
=================  ==========================  ==========================  ================
column-parallel    CP (full over TP: gathered  TP (rows)                   TP (columns), CP
                   under SP, else replicated)
row-parallel       TP (columns), CP            TP (columns)                CP
expert fc1 / fc2   one scale per token row     ETP                         per token row
=================  ==========================  ==========================  ================

Expert inputs are scaled per token: which tokens meet in one expert's GEMM depends on the
layout (expert parallelism gathers several ranks' micro-batches), a token's own row does not.
For the same reason delayed scaling covers the dense linears only; experts use current scales.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megazero.distributed.collectives import Group, group_rank, group_size
from megazero.fp8.delayed import AmaxHistory, finish_step
from megazero.fp8.formats import FP8Recipe, check_device_supports
from megazero.fp8.gemm import FP8Gemm
from megazero.fp8.quantize import Shard
from megazero.moe.experts import Experts
from megazero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

ROLES = ("x", "w", "dy")


@dataclass
class FP8Layers:
    """What :func:`apply_fp8` did on this rank: the FP8 GEMMs by module name (global layer
    indices, so names are the same at every layout), the layers left in bf16, and the groups
    a delayed-scaling step's amaxes are reduced over."""

    recipe: FP8Recipe
    gemms: dict[str, FP8Gemm] = field(default_factory=dict)
    fp8_layers: list[int] = field(default_factory=list)
    bf16_layers: list[int] = field(default_factory=list)
    step_groups: tuple[Group, ...] = ()
    #: each FP8 GEMM's weight and the groups that shard it (--fp8-param-gather)
    weights: list[tuple[nn.Parameter, tuple[Group, ...]]] = field(default_factory=list)

    def histories(self) -> Iterator[tuple[str, AmaxHistory]]:
        for name, gemm in sorted(self.gemms.items()):
            for role in ROLES:
                if role in gemm.histories:
                    yield f"{name}.{role}", gemm.histories[role]

    def finish_step(self) -> list[str]:
        """Delayed scaling: push this step's amaxes (max over every rank of the stage).
        Returns a line for each tensor whose scale saturated for the first time (the counts
        go on in :attr:`AmaxHistory.overflows` / ``underflows``)."""
        if self.recipe.recipe != "delayed":
            return []
        named = list(self.histories())
        out = []
        for (name, h), status in zip(named, finish_step((h for _, h in named),
                                                        self.step_groups), strict=True):
            if status is not None and h.overflows + h.underflows == 1:
                what = ("exceeded the FP8 maximum (values clipped)" if status == "overflow"
                        else "fell below the smallest normal FP8 value")
                out.append(f"FP8 {status}: {name}'s amax {float(h.history[0]):.4g} {what} "
                           f"under its delayed scale; raise --fp8-margin / "
                           f"--fp8-amax-history-len or use --fp8-recipe tensorwise (warned "
                           f"once per tensor, counted after)")
        return out

    def amaxes(self, patterns: Sequence[str]) -> dict[str, float]:
        """The newest amax of the operands whose ``<module>.<role>`` name matches: the
        step's reduced one under delayed scaling, the last use's otherwise. The experts have
        no one amax per operand (rows and experts scaled apart) and are not listed."""
        out = {}
        for name, gemm in self.gemms.items():
            if gemm.rowwise:  # experts: a scale per token row, and per expert weight
                continue
            for role in ROLES:
                key = f"{name}.{role}"
                if not any(fnmatch.fnmatchcase(key, p) for p in patterns):
                    continue
                h = gemm.histories.get(role)
                if h is not None:
                    out[key] = float(h.history[0])
                elif role in gemm.last_amax:
                    out[key] = float(gemm.last_amax[role])
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The amax histories by tensor name: layout-free (already reduced over the ranks)."""
        return {name: h.history.detach().cpu().clone() for name, h in self.histories()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Load the histories saved for this rank's tensors; returns the names it found none
        for (they start from an empty history)."""
        missing = []
        for name, h in self.histories():
            if name in state:
                h.load(state[name])
            else:
                missing.append(name)
        return missing

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over the world: every stage's histories, by global tensor name (each
        stage's ranks hold the same ones), for rank 0 to save."""
        import torch.distributed as dist

        mine = self.state_dict()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part or {})
        return dict(sorted(merged.items()))


def _shard(group: Group, stride: int = 1) -> Shard | None:
    size = group_size(group)
    return None if size == 1 else Shard(group_rank(group), size, stride, group)


def _dense_gemm(linear: ColumnParallelLinear | RowParallelLinear, recipe: FP8Recipe,
                cp: Group, name: str, device: torch.device) -> FP8Gemm:
    tp: Group = linear.group
    stride = getattr(linear.weight, "partition_stride", 1)
    histories = None
    if recipe.recipe == "delayed":
        dtypes = {"x": recipe.forward_dtype, "w": recipe.forward_dtype,
                  "dy": recipe.backward_dtype}
        histories = {r: AmaxHistory(recipe.amax_history_len, recipe.amax_compute_algo,
                                    dtypes[r], recipe.margin, device) for r in ROLES}
    if isinstance(linear, ColumnParallelLinear):
        return FP8Gemm(recipe, x_groups=(cp,), w_groups=(tp,), dy_groups=(tp, cp),
                       w_shard=_shard(tp, stride), w_shard_dim=0, dy_shard=_shard(tp, stride),
                       histories=histories, name=name)
    return FP8Gemm(recipe, x_groups=(tp, cp), w_groups=(tp,), dy_groups=(cp,),
                   x_shard=_shard(tp), w_shard=_shard(tp), w_shard_dim=1,
                   histories=histories, name=name)


def _expert_gemms(experts: Experts, recipe: FP8Recipe, name: str) -> tuple[FP8Gemm, FP8Gemm]:
    etp = experts.etp_group
    stride = 2 if experts.config.swiglu else 1
    fc1 = FP8Gemm(recipe, w_groups=(etp,), w_shard=_shard(etp, stride), w_shard_dim=0,
                  dy_shard=_shard(etp, stride), rowwise=True, name=f"{name}.fc1")
    fc2 = FP8Gemm(recipe, w_groups=(etp,), x_shard=_shard(etp), w_shard=_shard(etp),
                  w_shard_dim=1, rowwise=True, name=f"{name}.fc2")
    return fc1, fc2


def bf16_layer_indices(num_layers: int, first_last_bf16: bool, at_start: int, at_end: int
                       ) -> set[int]:
    """Megatron's ``--first-last-layers-bf16``: the first ``at_start`` and last ``at_end``
    layers (global, 0-based) keep bf16 GEMMs."""
    if not first_last_bf16:
        return set()
    return set(range(at_start)) | set(range(num_layers - at_end, num_layers))


def _transformer_layers(chunks: Iterable[nn.Module]) -> Iterator[tuple[int, str, nn.Module]]:
    """Every transformer layer of the chunks: its global number, name and module."""
    for chunk in chunks:
        for lname, layer in chunk.named_modules():
            number = getattr(layer, "layer_number", None)
            if number is not None and hasattr(layer, "self_attention"):
                yield number, lname, layer


def fp8_weights(chunks: Iterable[nn.Module], bf16_layers: set[int]) -> list[nn.Parameter]:
    """The weights :func:`apply_fp8` gives FP8 GEMMs, known before it runs: ZeRO 1-2 lay them
    into buckets of their own when they are gathered in FP8 (``--fp8-param-gather``), and the
    buckets are cut when the optimizer is built, before the GEMMs are."""
    out = []
    for number, lname, layer in _transformer_layers(chunks):
        if number in bf16_layers:
            continue
        for _, module in layer.named_modules(prefix=lname):
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                out.append(module.weight)
            elif isinstance(module, Experts):
                for e in module.local_experts.values():
                    for linear in ("linear_fc1", "linear_fc2"):
                        weight = e.get_submodule(linear).weight
                        assert isinstance(weight, nn.Parameter)
                        out.append(weight)
    return out


def apply_fp8(chunks: Iterable[nn.Module], recipe: FP8Recipe, *, bf16_layers: set[int],
              cp_group: Group, step_groups: tuple[Group, ...], device: torch.device
              ) -> FP8Layers:
    """Give every linear of every transformer layer not in ``bf16_layers`` its FP8 GEMMs."""
    check_device_supports(recipe, device)
    out = FP8Layers(recipe, step_groups=step_groups)
    for number, lname, layer in _transformer_layers(chunks):
        if number in bf16_layers:
            out.bf16_layers.append(number)
            continue
        out.fp8_layers.append(number)
        for mname, module in layer.named_modules(prefix=lname):
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                gemm = _dense_gemm(module, recipe, cp_group, mname, device)
                module.gemm = out.gemms[mname] = gemm
                out.weights.append((module.weight, gemm.w_groups))
            elif isinstance(module, Experts):
                fc1, fc2 = _expert_gemms(module, recipe, mname)
                module.gemms = (fc1, fc2)
                out.gemms[f"{mname}.fc1"], out.gemms[f"{mname}.fc2"] = fc1, fc2
                for e in module.local_experts.values():
                    for linear, g in (("linear_fc1", fc1), ("linear_fc2", fc2)):
                        weight = e.get_submodule(linear).weight
                        assert isinstance(weight, nn.Parameter)
                        out.weights.append((weight, g.w_groups))
    out.fp8_layers.sort()
    out.bf16_layers.sort()
    return out
