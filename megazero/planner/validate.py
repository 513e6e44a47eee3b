"""The planner's per-rank memory against real iterations of the same layout.

:func:`measure_layouts` runs inside a spawned world (one process per rank). For each layout
(command-line flags) it builds the model chunks and the ZeRO engine as ``pretrain_gpt.py``
does, runs ``iters`` training iterations (pipeline executor, gradient sync, optimizer step) and
returns, per rank, the measured and the predicted:

* **saved activation bytes**: the executor's activation meter (``stats["peak_saved_bytes"]``
  of the last iteration: the peak, over the schedule, of the storages autograd holds for
  backward) against :func:`megazero.planner.activations.peak_saved_bytes` (the same schedule
  walked with the planner's per-layer bytes);
* **peak memory**: the most bytes of live tensor storage during the last iteration, against the
  planner's device total (:func:`megazero.planner.estimate.rank_memory`). On CUDA the measure
  is ``torch.cuda.max_memory_allocated()`` after a reset before the iteration. On CPU it is the
  CPU allocator's own count of live bytes as the profiler reports it (``profile_memory``: every
  allocation and free of tensor storage made while profiling, with the running total), started
  before the model is built so every tensor the run creates is counted, and read over the last
  iteration's span. It is a measurement of what is allocated, independent of the planner's
  items (weights, grads, optimizer states, buckets, activations, logits, p2p buffers alike).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

WINDOW = "megazero.validate.last_iteration"


class LiveBytes:
    """Peak live tensor bytes in a marked window: CUDA allocator statistics, or on CPU the
    profiler's allocator events (``Total Allocated`` running count, relative to the count when
    tracking started)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.peak: float | None = None
        self._prof: Any = None

    def __enter__(self) -> LiveBytes:
        if not self.cuda:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.peak = float(torch.cuda.max_memory_allocated())
            return
        with torch.profiler.record_function(WINDOW):
            yield

    def __exit__(self, *exc: Any) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        mem = sorted((e for e in events if e.get("name") == "[memory]"
                      and e["args"].get("Device Type", 0) == 0), key=lambda e: e["ts"])
        spans = [e for e in events if e.get("name") == WINDOW and e.get("ph") == "X"]
        if not mem or not spans:
            raise RuntimeError("the profiler recorded no CPU memory events or no window")
        # The allocator's running total also moves for storages allocated before this
        # profile (their frees may be reported or not): count only storages allocated here.
        t0 = spans[-1]["ts"]
        t1 = t0 + spans[-1]["dur"]
        sizes: dict[int, int] = {}
        live, peak, peak_ts = 0, None, t0
        for e in mem:
            if e["ts"] > t1:
                break
            if e["ts"] >= t0 and peak is None:
                peak = live
            a = e["args"]
            if a["Bytes"] > 0:
                sizes[a["Addr"]] = a["Bytes"]
                live += a["Bytes"]
            elif a["Addr"] in sizes:
                live -= sizes.pop(a["Addr"])
            if peak is not None and live > peak:
                peak, peak_ts = live, e["ts"]
        self.peak = float(live if peak is None else peak)
        if os.environ.get("MEGAZERO_VALIDATE_DEBUG"):  # what is live at the peak, by op
            self.live_at_peak = self._live_at(events, mem, peak_ts, t0)

    @staticmethod
    def _live_at(events: list[dict], mem: list[dict], ts: float, t0: float) -> list[Any]:
        live: dict[int, dict] = {}
        for e in mem:
            if e["ts"] > ts:
                break
            if e["args"]["Bytes"] > 0:
                live[e["args"]["Addr"]] = e
            else:
                live.pop(e["args"]["Addr"], None)
        ops = [o for o in events if o.get("ph") == "X" and o.get("cat") == "cpu_op"]
        out = []
        for e in sorted(live.values(), key=lambda e: -e["args"]["Bytes"])[:300]:
            names = [o["name"] for o in ops if o["ts"] <= e["ts"] <= o["ts"] + o.get("dur", 0)]
            out.append((e["args"]["Bytes"], e["ts"] >= t0, names[:3]))
        return out


def measure_layouts(rank: int, world: int, layouts: list[list[str]], iters: int = 2,
                    track_memory: bool = True) -> list[dict[str, Any]]:
    """Run every layout (full flag lists) ``iters`` iterations on this rank; one row each."""
    from megazero.arguments import load_config
    from megazero.pipeline.executor import forward_backward
    from megazero.planner.activations import core_attention_saves_scores, peak_saved_bytes
    from megazero.planner.estimate import rank_memory
    from megazero.testing.batches import random_lm_batches
    from megazero.topology import ParallelTopology
    from megazero.train_setup import build_model_and_optimizer

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        and torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for flags in layouts:
        gc.collect()
        cfg = load_config(flags, world)
        p, t = cfg.parallel, cfg.train
        topo = ParallelTopology.build(tp=p.tp, pp=p.pp, vpp=cfg.vpp)
        m = (t.global_batch_size or t.micro_batch_size * topo.dp_size) // (
            t.micro_batch_size * topo.dp_size)
        sp = p.sequence_parallel and p.tp > 1
        stats: dict[str, Any] = {}
        tracker = LiveBytes(device) if track_memory else None
        with tracker if tracker is not None else contextlib.nullcontext():
            chunks, engine = build_model_and_optimizer(cfg, topo, device)
            for it in range(iters):
                batches = random_lm_batches(m, cfg.model.vocab_size, t.micro_batch_size,
                                            cfg.model.seq_length, seed=it * 1000 + topo.dp_rank)
                batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
                last = it == iters - 1
                with tracker.window() if (tracker is not None and last) else \
                        contextlib.nullcontext():
                    forward_backward(
                        chunks, iter(batches), topo, m, cfg.model.seq_length,
                        t.micro_batch_size, cfg.model.hidden_size, sequence_parallel=sp,
                        dtype=cfg.precision.params_dtype, grad_sync=engine,
                        stats=stats if last else None,
                        microbatch_group_size=p.microbatch_group_size_per_vp_stage)
                    engine.finish_grad_sync()
                    engine.step()
                    del batches
        cpu = device.type == "cpu"
        flash = not core_attention_saves_scores(cfg, cpu)
        plan = rank_memory(cfg, topo.pp_rank, m, flash=flash, device_is_cpu=cpu)
        rows.append(dict(
            flags=flags, rank=topo.rank, pp_rank=topo.pp_rank, tp_rank=topo.tp_rank,
            dp_rank=topo.dp_rank, microbatches=m,
            measured_saved=stats["peak_saved_bytes"],
            predicted_saved=peak_saved_bytes(cfg, topo.pp_rank, m, flash=flash),
            measured_peak=tracker.peak if tracker is not None else None,
            predicted_peak=plan.device_total, items=dict(plan.items),
            engine_device_total=engine.memory_report()["device_total"],
            live_at_peak=getattr(tracker, "live_at_peak", None)))
        del chunks, engine
    return rows
