"""The FLOPs profiler: DeepSpeed's ``"flops_profiler"`` block.

::

    "flops_profiler": {"enabled": true, "profile_step": 3, "module_depth": -1,
                       "top_modules": 1, "detailed": true, "output_file": null}

Iteration ``profile_step`` (1-based, as the log numbers them) runs on every rank under torch's
``FlopCounterMode``: each matrix multiplication, batched one and attention kernel the rank
executes is counted (two FLOPs per multiply-add), forward, backward and recomputed forward
alike, and charged to the module that ran it. Rank 0 then prints (or writes to
``output_file``) a report:

* the layout, the iteration's latency, this rank's parameters and counted FLOPs (and MACs);
* the FLOPs counted on all ranks together against the *model* FLOPs of the iteration that the
  log line's TFLOP/s and MFU are computed from
  (:func:`megazero.observability.flops.gpt_flops_per_iteration`), with their ratio. Fused attention
  kernels (SDPA's flash, memory-efficient and cuDNN kernels) recompute the score matrix in
  backward, which the model formula does not count: the report gives that part and the ratio
  without it. That second ratio is 1 for a dense model without recomputation: both count every GEMM
  once forward and twice backward, attention over the whole score square. Full recomputation adds
  one forward of each layer (*hardware* FLOPs, about 4/3 of the model's); a context-parallel ring
  skips the score blocks above the diagonal; MoE layers count the rows their experts ran, padding
  included, against the active experts' share;
* achieved TFLOP/s per device, counted (hardware) and model (the log line's);
* the ``top_modules`` modules with the most FLOPs at each depth down to ``module_depth``
  (``-1``: every depth), and with ``detailed`` every module down to that depth with its
  parameters, FLOPs and their shares of rank 0's totals.

Unlike DeepSpeed's profiler, which times one forward pass with module hooks and takes the
backward to cost twice the forward, the whole iteration is counted as it ran (every
micro-batch of the pipeline schedule, backward, recomputation), so ``recompute_fwd_factor`` is
not needed, and latencies are given for the iteration, not per module. Operators outside
torch's FLOP registry are not counted: flash-attn's kernels (the ``flash`` attention backend,
CUDA) among them; the report names the backend. With virtual pipeline stages the chunks of a
rank have the same module names, and their counts are added together. Under full
recomputation a layer's recomputed forward and its backward run inside the checkpointed block,
and are charged to the module that holds the block (the decoder), not to the layer.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import flop_counter

from megazero.config.observability_schema import FlopsProfilerSettings

GLOBAL = "Global"  # FlopCounterMode's key for everything counted
# Fused attention backward kernels that recompute the score matrix: one of the five GEMMs torch
# counts for them (scores again, dV, dP, dQ, dK); the model formula counts the other four.
RECOMPUTING_ATTENTION_BACKWARD = (
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_backward", "_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward")


def _sdpa_cpu_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(query, key, value))  # type: ignore[no-untyped-call]


def _sdpa_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                       out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
        grad_out, query, key, value))


def _grouped_mm(mat_a: Any, mat_b: Any, *args: Any, out_shape: Any = None,
                **kwargs: Any) -> int:
    """``torch._grouped_mm``: two 2-D operands split the contraction into groups (the experts'
    weight gradients), so all of it is done once; otherwise every output element is one dot
    product over ``mat_a``'s last dimension."""
    if len(mat_a) == 2 and len(mat_b) == 2:
        return int(2 * mat_a[0] * mat_a[1] * mat_b[1])
    return int(2 * math.prod(out_shape) * mat_a[-1])


def extra_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for kernels megazero runs that torch's registry leaves out: the CPU flash
    SDPA kernel (counted as torch counts its CUDA sibling) and the MoE experts' grouped GEMM
    (``torch._grouped_mm``)."""
    aten = torch.ops.aten
    out: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm] = _grouped_mm
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_forward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward
    return out


def human(value: float, unit: str) -> str:
    """``1.23 G<unit>``: 1000-based, as FLOP counts are read."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def module_parameters(chunks: Iterable[torch.nn.Module],
                      shapes: Mapping[int, torch.Size] | None = None) -> dict[str, int]:
    """Parameters (this rank's: TP shards, ZeRO-3 partitions at their full shard size) of each
    module, keyed as ``FlopCounterMode`` names modules: the root's class, then the attribute
    path."""
    out: dict[str, int] = {}
    for chunk in chunks:
        root = type(chunk).__name__
        for name, module in chunk.named_modules():
            key = f"{root}.{name}" if name else root
            n = sum(math.prod(shapes[id(p)]) if shapes and id(p) in shapes else p.numel()
                    for p in module.parameters())
            out[key] = out.get(key, 0) + n
    return out


def depth_of(name: str) -> int:
    return name.count(".")


def module_flops(counts: Mapping[str, float], names: Iterable[str]) -> dict[str, float]:
    """Each module's FLOPs: its count, or for a container that never ran itself (a
    ``ModuleList`` of layers) the sum of its children's."""
    names = set(names) | {n for n in counts if n != GLOBAL}
    children: dict[str, list[str]] = {}
    for n in names:
        if "." in n:
            children.setdefault(n.rsplit(".", 1)[0], []).append(n)
    out: dict[str, float] = {}

    def flops(n: str) -> float:
        if n not in out:
            out[n] = counts[n] if n in counts else sum(flops(c) for c in children.get(n, []))
        return out[n]

    for n in names:
        flops(n)
    return out


class FlopsProfiler:
    """Counts iteration ``profile_step``; see the module docstring. ``before``/``after`` are
    called around every iteration by every rank (``after`` of the profiled one sums the counts
    over the world: a collective)."""

    def __init__(self, settings: FlopsProfilerSettings, chunks: list[torch.nn.Module],
                 device: torch.device, layout: str, attention: str,
                 model_flops: Callable[[], float],
                 shapes: Mapping[int, torch.Size] | None = None) -> None:
        self.settings = settings
        self.chunks = chunks
        self.device = device
        self.layout = layout
        self.attention = attention
        self.model_flops = model_flops
        self.shapes = shapes
        self._mode: Any = None
        self._start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, iteration: int) -> None:
        if not self.settings.enabled or iteration != self.settings.profile_step:
            return
        self._mode = flop_counter.FlopCounterMode(display=False,
                                                  custom_mapping=extra_formulas())
        self._mode.__enter__()
        self._sync()
        self._start = time.perf_counter()

    def after(self, iteration: int) -> str | None:
        """The report, on rank 0 of the profiled iteration when no ``output_file`` is set
        (written there otherwise); None elsewhere."""
        if self._mode is None or iteration != self.settings.profile_step:
            return None
        self._sync()
        latency = time.perf_counter() - self._start
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        by_module = mode.get_flop_counts()
        counts = {name: float(sum(ops.values())) for name, ops in by_module.items()}
        rescored = sum(count / 5 for op, count in by_module.get(GLOBAL, {}).items()
                       if _op_name(op) in RECOMPUTING_ATTENTION_BACKWARD)
        world = 1
        total = [counts.get(GLOBAL, 0.0), float(rescored)]
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            t = torch.tensor(total, dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            total = t.tolist()
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return None
        text = self.report(iteration, latency, counts, total[0], total[1], world)
        if self.settings.output_file:
            directory = os.path.dirname(os.path.abspath(self.settings.output_file))
            os.makedirs(directory, exist_ok=True)
            with open(self.settings.output_file, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            return None
        return text

    def report(self, iteration: int, latency: float, counts: Mapping[str, float],
               total: float, rescored: float, world: int) -> str:
        """The text (see the module docstring); ``total``: FLOPs counted on all ranks,
        ``rescored``: the part that fused attention backward kernels spent recomputing
        scores."""
        mine = counts.get(GLOBAL, 0.0)
        params = module_parameters(self.chunks, self.shapes)
        rank_params = sum(v for k, v in params.items() if "." not in k)
        model = self.model_flops()

        def ratio(flops: float) -> str:
            return f"{flops / model:.4f}" if model else "n/a"

        per_device = latency * world
        rows = [
            ("layout", self.layout),
            ("attention kernel", self.attention),
            ("iteration latency", f"{latency * 1e3:.2f} ms"),
            ("parameters on rank 0", human(rank_params, "")),
            ("FLOPs counted on rank 0 (fwd + bwd + recompute)",
             f"{human(mine, 'FLOP')} ({human(mine / 2, 'MAC')})"),
            (f"FLOPs counted on all {world} ranks", human(total, "FLOP")),
            ("of which attention scores recomputed in backward", human(rescored, "FLOP")),
            ("model FLOPs of the iteration (megazero/observability/flops.py)", human(model,
            "FLOP")), ("counted / model", ratio(total)),
            ("counted without the recomputed scores / model", ratio(total - rescored)),
            ("FLOP/s per device, counted (hardware)",
             human(total / per_device if per_device else 0.0, "FLOP/s")),
            ("FLOP/s per device, model (the log line's TFLOP/s)",
             human(model / per_device if per_device else 0.0, "FLOP/s")),
        ]
        lines = [f"{' megazero flops profiler: iteration ' + str(iteration) + ' ':-^96}"]
        lines += [f"{label + ':':<52} {value}" for label, value in rows]
        flops = module_flops(counts, params)
        depth_limit = self.settings.module_depth
        deepest = max((depth_of(n) for n in flops), default=-1)
        last = deepest if depth_limit < 0 else min(depth_limit, deepest)
        if flops:
            lines.append(f"top {self.settings.top_modules} module(s) by FLOPs at each depth "
                         f"on rank 0:")
            for depth in range(last + 1):
                ranked = sorted((n for n in flops if depth_of(n) == depth and flops[n] > 0),
                                key=lambda n: -flops[n])[:self.settings.top_modules]
                shown = ", ".join(f"{n}: {human(flops[n], 'FLOP')}" for n in ranked)
                lines.append(f"  depth {depth}: {shown or '-'}")
        if self.settings.detailed:
            lines.append("detailed profile on rank 0 (module: parameters, share; FLOPs, "
                         "share):")
            for name in sorted(flops, key=_tree_order):
                if depth_limit >= 0 and depth_of(name) > depth_limit:
                    continue
                p, f = params.get(name, 0), flops[name]
                lines.append(
                    f"{'  ' * depth_of(name)}{name.rsplit('.', 1)[-1]}: "
                    f"{human(p, '')}, {100 * p / rank_params if rank_params else 0:.2f}%; "
                    f"{human(f, 'FLOP')}, {100 * f / mine if mine else 0:.2f}%")
        lines.append("-" * 96)
        return "\n".join(lines)


def _op_name(op: Any) -> str:
    """``aten.<name>`` or ``aten.<name>.<overload>`` -> ``<name>``."""
    return str(op).split(".")[1]


def _tree_order(name: str) -> list[Any]:
    """Depth-first order with numbered children (layers.2 before layers.10) in number order."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def for_run(run: Any, model_flops: Callable[[], float]) -> FlopsProfiler:
    """The profiler of a ``pretrain_gpt.py`` run (:class:`megazero.training.run.Run`) from its
    config's ``flops_profiler`` block."""
    from megazero.model.attention_probe import describe_attention

    cfg, topo, b = run.cfg, run.topo, run.batching
    settings = FlopsProfilerSettings.from_block(cfg.logging.flops_profiler)
    shapes: dict[int, torch.Size] = {}
    for store in run.engine.stores:  # ZeRO-3 keeps each parameter's full (TP-shard) shape
        shapes.update(store.param_shapes())
    m = cfg.model
    dtype = (torch.float16 if cfg.precision.fp16 else torch.bfloat16 if cfg.precision.bf16
             else torch.float32)
    attention = describe_attention(
        "auto", m.use_flash_attn, run.env.device, dtype,
        max(1, m.num_attention_heads // topo.tp_size), max(1, m.query_groups // topo.tp_size),
        m.head_dim, m.attention_dropout) if settings.enabled else ""
    recompute = cfg.parallel.recompute_granularity or "none"
    layout = (f"world {topo.world_size} = tp {topo.tp_size} x pp {topo.pp_size} x cp "
              f"{topo.cp_size} x dp {topo.dp_size} (ep {topo.ep_size}, vpp {topo.vpp_size or 1}),"
              f" ZeRO {cfg.zero.stage}, recompute {recompute}; micro-batch "
              f"{b.micro_batch_size} x {b.num_microbatches} per rank, sequence {m.seq_length}")
    return FlopsProfiler(settings, run.chunks, run.env.device, layout, attention, model_flops,
                         shapes)
