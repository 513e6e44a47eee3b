"""What a run reports: the Megatron-style log line, TensorBoard, wandb, CSV, JSON lines, timers.

One :class:`Monitor` per process; only the process chosen to report (the one that holds the
loss, see :mod:`megazero.training.step`) gets ``enabled=True`` and opens any writer, so files are
written once per run. Every sink is optional and a missing package (tensorboard, wandb) is
reported once and then ignored: monitoring never stops a training run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from megazero.config import LoggingConfig
from megazero.observability.flops import mfu as model_flops_utilisation
from megazero.observability.flops import tflops_per_device
from megazero.observability.timers import Timers

__all__ = ["Monitor", "Timers", "format_breakdown", "format_log_line"]

# Megatron's TensorBoard tags.
TB_TAGS = ("lm loss", "lm loss validation", "learning-rate", "grad-norm", "loss-scale",
           "batch-size", "iteration-time")


GPU_MEMORY = "peak memory (MB)"


def peak_memory() -> tuple[str, float]:
    """``(label, MB)``: the CUDA allocator's peak on GPU, else this process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return GPU_MEMORY, torch.cuda.max_memory_allocated() / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    mb = rss_kb / 2**20 if sys.platform == "darwin" else rss_kb / 1024
    return "peak RSS (MB)", mb


@dataclass
class IntervalStats:
    """Sums over one log interval (Megatron's ``total_loss_dict``)."""

    iterations: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    skipped: int = 0
    nan: int = 0
    seconds: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)


def format_log_line(iteration: int, train_iters: int, consumed_samples: int, ms_per_iter: float,
                    lr: float, global_batch_size: int, loss: float | None,
                    loss_scale: float | None, grad_norm: float | None, skipped: int, nan: int,
                    tokens_per_second: float, tflops: float, memory: tuple[str, float],
                    breakdown_ms: dict[str, float] | None = None,
                    mfu: float | None = None, num_zeros: float | None = None) -> str:
    """The Megatron-style line users grep for (``lm loss: ...`` etc.). ``mfu`` (model FLOPs
    utilisation) appears only when the device's peak FLOP/s is known."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    if loss is not None:
        parts.append(f"lm loss: {loss:.6E}")
    if loss_scale is not None:
        parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros:.1f}")
    parts += [
        f"number of skipped iterations: {skipped:3d}",
        f"number of nan iterations: {nan:3d}",
        f"tokens per second: {tokens_per_second:.1f}",
        # On the CPU a rank is a process, not a GPU (the memory column says which it is).
        f"TFLOP/s per {'GPU' if memory[0] == GPU_MEMORY else 'process'}: {tflops:.2f}",
    ]
    if mfu is not None:
        parts.append(f"MFU: {100.0 * mfu:.1f}%")
    parts += [
        f"{memory[0]}: {memory[1]:.1f}",
    ]
    for name, ms in (breakdown_ms or {}).items():
        parts.append(f"{name} (ms): {ms:.1f}")
    return " | ".join(parts) + " |"


def breakdown_scalars(breakdown_ms: dict[str, float], loop_ms: float,
                      overlapped_ms: dict[str, float]) -> dict[str, float]:
    """JSON/wandb keys of the breakdown: ``time/<region>_ms``, ``time/loop_ms``,
    ``time/accounted`` (the regions' sum over the loop time) and ``overlapped/<op>_ms``."""
    if not breakdown_ms:
        return {}
    out = {f"time/{k}_ms": v for k, v in breakdown_ms.items()}
    out["time/loop_ms"] = loop_ms
    out["time/accounted"] = sum(breakdown_ms.values()) / loop_ms if loop_ms > 0 else 0.0
    out.update({f"overlapped/{k}_ms": v for k, v in overlapped_ms.items()})
    return out


def format_breakdown(breakdown_ms: dict[str, float], loop_ms: float,
                     overlapped_ms: dict[str, float] | None = None) -> str:
    """`` time breakdown (ms per iteration): loop 227.0 = forward 40.1 + ... (99.1% accounted)
    | in flight beside them: comm dp/all_reduce 12.0``: largest region first."""
    total = sum(breakdown_ms.values())
    parts = " + ".join(f"{k} {v:.1f}" for k, v in
                       sorted(breakdown_ms.items(), key=lambda kv: -kv[1]))
    share = 100.0 * total / loop_ms if loop_ms > 0 else 0.0
    line = (f" time breakdown (ms per iteration): loop {loop_ms:.1f} = {parts} "
            f"({share:.1f}% accounted)")
    if overlapped_ms:
        line += " | in flight beside them: " + ", ".join(
            f"{k.removesuffix(' in flight')} {v:.1f}" for k, v in sorted(overlapped_ms.items()))
    return line


class Monitor:
    """Log line + TensorBoard + wandb + csv + JSON lines for the reporting process."""

    def __init__(self, config: LoggingConfig, enabled: bool, log_json: str | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        self.config = config
        self.enabled = enabled
        self.stats = IntervalStats()
        self.memory_phases: dict[str, float] = {}
        self._interval_start = time.perf_counter()
        self._tb: Any = None
        self._wandb: Any = None
        self._csv_dir: str | None = None
        self._json: Any = None
        if not enabled:
            return
        if config.tensorboard_dir:
            self._tb = _open_tensorboard(config.tensorboard_dir, config.tensorboard_job_name,
                                         config.tensorboard_queue_size)
        if config.wandb_block.get("enabled"):
            self._wandb = _open_wandb(config.wandb_block, run_config)
        if config.csv_monitor.get("enabled"):
            path = config.csv_monitor.get("output_path") or "csv_monitor"
            self._csv_dir = os.path.join(path, config.csv_monitor.get("job_name") or "megazero")
            os.makedirs(self._csv_dir, exist_ok=True)
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self._json = open(log_json, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    # --- per iteration -------------------------------------------------------------------------

    def start_interval(self) -> None:
        """The training loop starts: the first log interval's wall time counts from here."""
        self._interval_start = time.perf_counter()

    def record(self, loss: float | None, skipped: bool, seconds: float,
               breakdown: dict[str, float] | None = None, nonfinite: bool = False) -> None:
        """Accumulate one iteration into the current log interval. ``nonfinite``: the step
        saw a NaN/inf loss or gradient (counted as a nan iteration even if the loss is finite)."""
        s = self.stats
        s.iterations += 1
        s.seconds += seconds
        finite = loss is not None and math.isfinite(loss)
        if nonfinite or (loss is not None and not finite):
            s.nan += 1  # whether or not its update was skipped
        if skipped:
            s.skipped += 1
        elif finite and loss is not None:
            s.loss_sum += loss
            s.loss_count += 1
        for k, v in (breakdown or {}).items():
            s.breakdown[k] = s.breakdown.get(k, 0.0) + v

    def record_memory(self, phases: dict[str, float]) -> None:
        """``--log-memory-phases``: bytes after forward/backward/step of the last iteration;
        written with the next log line as ``mem-after-forward`` ... scalars."""
        self.memory_phases = dict(phases)

    def report(self, iteration: int, train_iters: int, consumed_samples: int, lr: float,
               global_batch_size: int, seq_length: int, loss_scale: float | None,
               grad_norm: float | None, flops_per_iteration: float, world_size: int,
               peak_flops: float | None = None,
               overlapped: dict[str, float] | None = None,
               num_zeros: float | None = None,
               moe: dict[str, float] | None = None,
               fp8: dict[str, float] | None = None) -> None:
        """Print the interval's log line and write every scalar sink; reset the interval.

        With ``wall_clock_breakdown`` the iterations' regions (:class:`Timers`) are printed on
        a second line, per iteration, against the loop time (the interval's wall time over its
        iterations, logging included), with the share of it they account for; ``overlapped``
        (asynchronous collectives' in-flight seconds) is printed apart. Timed for
        ``--log-timers-to-tensorboard`` alone, they are written, not printed."""
        s, self.stats = self.stats, IntervalStats()
        now = time.perf_counter()
        wall, self._interval_start = now - self._interval_start, now
        if not self.enabled or s.iterations == 0:
            return
        sec = s.seconds / s.iterations
        loss = s.loss_sum / s.loss_count if s.loss_count else None
        tokens = global_batch_size * seq_length / sec if sec > 0 else 0.0
        tflops = tflops_per_device(flops_per_iteration, sec, world_size)
        mfu = model_flops_utilisation(flops_per_iteration, sec, world_size, peak_flops)
        mem = peak_memory()
        breakdown_ms = {k: 1000.0 * v / s.iterations for k, v in s.breakdown.items()}
        overlapped_ms = {k: 1000.0 * v / s.iterations for k, v in (overlapped or {}).items()}
        loop_ms = 1000.0 * wall / s.iterations
        line = format_log_line(iteration, train_iters, consumed_samples, 1000.0 * sec, lr,
                               global_batch_size, loss, loss_scale, grad_norm, s.skipped, s.nan,
                               tokens, tflops, mem, None, mfu, num_zeros)
        mtp = {k: v for k, v in (moe or {}).items() if k.startswith("mtp_")}
        routers = {k: v for k, v in (moe or {}).items() if k not in mtp}
        if routers:  # MoE routers' scalars (megazero.moe.metrics)
            from megazero.moe.metrics import log_line_part

            line += log_line_part(routers)
        line += "".join(f" {k}: {v:.6E} |" for k, v in mtp.items())  # multi-token prediction
        for name, value in (fp8 or {}).items():  # --log-fp8-amax
            line += f" {name.replace('-', ' ', 1)}: {value:.4E} |"
        print(line, flush=True)
        if breakdown_ms and self.config.wall_clock_breakdown:
            print(format_breakdown(breakdown_ms, loop_ms, overlapped_ms), flush=True)
        scalars: dict[str, float] = {"learning-rate": lr, "batch-size": global_batch_size,
                                     "iteration-time": sec}
        if loss is not None:
            scalars["lm loss"] = loss
        if loss_scale is not None:
            scalars["loss-scale"] = loss_scale
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        if num_zeros is not None:
            scalars["num-zeros"] = num_zeros
        scalars.update(moe or {})
        scalars.update(fp8 or {})
        scalars.update(self.memory_phases)
        scalars.update(breakdown_scalars(breakdown_ms, loop_ms, overlapped_ms))
        self.memory_phases = {}
        self.write_scalars(iteration, scalars, extra={
            "consumed_samples": consumed_samples, "tokens_per_second": tokens,
            "tflops_per_device": tflops, "mfu": mfu, "skipped": s.skipped, "nan": s.nan,
            "memory_mb": mem[1]})
        if self.config.log_batch_size_to_tensorboard:
            self.write_vs_samples(consumed_samples, {"batch-size": global_batch_size})

    def report_validation(self, iteration: int, loss: float, label: str = "validation",
                          consumed_samples: int | None = None) -> None:
        if not self.enabled:
            return
        ppl = _perplexity(loss)
        line = (f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |")
        bar = "-" * len(line)
        print(f"{bar}\n{line}\n{bar}", flush=True)
        self.write_scalars(iteration, {f"lm loss {label}": loss, f"lm loss {label} ppl": ppl})
        if self.config.log_validation_ppl_to_tensorboard and consumed_samples is not None:
            self.write_vs_samples(consumed_samples, {f"lm loss {label} ppl": ppl})

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    # --- sinks ---------------------------------------------------------------------------------

    def write_scalars(self, iteration: int, scalars: dict[str, float],
                      extra: dict[str, Any] | None = None) -> None:
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, iteration)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**scalars, **(extra or {})}, step=iteration)
        if self._csv_dir is not None:
            for tag, value in scalars.items():
                _append_csv(self._csv_dir, tag, iteration, value)
        if self._json is not None:
            self._json.write(json.dumps({"iteration": iteration, **scalars, **(extra or {})})
                             + "\n")
            self._json.flush()

    def write_vs_samples(self, consumed_samples: int, scalars: dict[str, float]) -> None:
        """Megatron's ``<tag> vs samples`` TensorBoard series: x is the samples consumed."""
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(f"{tag} vs samples", value, consumed_samples)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._json is not None:
            self._json.close()
            self._json = None


def _perplexity(loss: float) -> float:
    """exp(loss), with Megatron's cap on the exponent so a large loss gives a finite PPL; a
    NaN loss gives NaN (``min(20, nan)`` would be 20: a NaN run reporting PPL 4.85E+08)."""
    if math.isnan(loss):
        return math.nan
    return math.exp(min(20.0, loss))


def _open_tensorboard(directory: str, job_name: str | None, max_queue: int = 1000) -> Any:
    path = os.path.join(directory, job_name) if job_name else directory
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard is a dependency, but a stripped install may lack it
        warnings.warn(f"TensorBoard logging to {path} is off: {e} (pip install tensorboard)",
                      stacklevel=2)
        return None
    return SummaryWriter(log_dir=path, max_queue=max_queue)


def _open_wandb(block: dict[str, Any], run_config: dict[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError:
        warnings.warn("wandb.enabled is true but the wandb package is not installed "
                      "(pip install wandb); training continues without wandb logging",
                      stacklevel=2)
        return None
    wandb.init(project=block.get("project") or "megazero", group=block.get("group"),
               entity=block.get("team"), name=block.get("job_name"),
               dir=block.get("output_path"), config=run_config)
    return wandb


def _append_csv(directory: str, tag: str, iteration: int, value: float) -> None:
    """DeepSpeed's csv_monitor layout: one ``<tag>.csv`` per scalar with ``step,<tag>`` rows."""
    path = os.path.join(directory, tag.replace("/", "_").replace(" ", "_") + ".csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["step", tag])
        w.writerow([iteration, value])
