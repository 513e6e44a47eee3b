"""The training rows: a small GPT at each ZeRO stage, saved and resumed, against one rank.

Each layout row trains through :func:`megazero.training.lifecycle.setup` and
:func:`megazero.training.loop.train`, the code ``pretrain_gpt.py`` runs, on mock data: once
uninterrupted, and once stopped by ``--exit-interval`` (which saves, as a pre-empted job does) and
resumed with ``--load``. The global batch is one micro-batch per rank, so the one-rank reference (a
subprocess of rank 0, :mod:`megazero.cluster_check.reference`) trains the same batches by gradient
accumulation: every layout trains the same model, so the losses agree to the precision's rounding.
The rows are data parallel over every rank (the job's ``--tensor-model-parallel-size`` and
``--pipeline-model-parallel-size`` shape the collective rows only).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from megazero.cluster_check import Row

# A GPT small enough for any GPU and for the CPU suite, big enough to have every kind of layer.
TINY_GPT = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--lr", "3e-3",
            "--lr-warmup-iters", "0", "--lr-decay-style", "cosine", "--lr-decay-iters", "100",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1000",
            "--eval-interval", "1000", "--eval-iters", "0", "--seed", "7"]
MICRO = 2
# Largest relative loss difference accepted against the one-rank run: fp32 differs only by the
# order of sums (observed <= 3e-8 over 20 iterations); 16-bit formats by their rounding.
RTOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
# Resumed against uninterrupted, the same layout: bitwise on CPU; on GPUs kernels that are not
# deterministic (atomics) may differ in the last bits.
RESUME_RTOL = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 5e-3}
PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}


def layout_args(stage: int, precision: str, offload: bool, world: int, iters: int,
                workdir: str, backend: str) -> list[str]:
    """Flags of one layout row (without ``--train-iters``/``--save``/``--load``)."""
    args = [*TINY_GPT, "--global-batch-size", str(MICRO * world), "--zero-stage", str(stage),
            "--distributed-backend", backend, *PRECISION_FLAGS[precision]]
    if offload:
        path = os.path.join(workdir, f"offload-zero{stage}.json")
        if dist.get_rank() == 0:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"zero_optimization": {"stage": stage,
                                                 "offload_optimizer": {"device": "cpu"}}}, f)
        dist.barrier()
        args += ["--deepspeed-config", path]
    return args


def train_losses(args: list[str]) -> tuple[dict[int, float], str]:
    """Train one run of ``args`` in this world (or a world of one); ``({iteration: loss},
    what it printed)``."""
    from megazero.config import load_config
    from megazero.training.lifecycle import setup
    from megazero.training.loop import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        world = dist.get_world_size() if dist.is_initialized() else 1
        run = setup(load_config(args, world))
        try:
            state = train(run)
        finally:
            run.monitor.close()
            if run.watchdog is not None:
                run.watchdog.stop()
        run.engine.wait_for_params()  # nothing in flight (NCCL aborts what is)
        run.topo.destroy_groups()  # the next layout makes its own
    return {int(h["iteration"]): float(h["loss"]) for h in state.history}, out.getvalue()


def max_rel_diff(got: dict[int, float], want: dict[int, float]) -> float:
    if set(got) != set(want):
        return float("inf")
    return max(abs(got[i] - want[i]) / max(abs(want[i]), 1e-12) for i in want)


def layout_rows(stage: int, precision: str, offload: bool, reference: dict[int, float],
                iters: int, workdir: str, backend: str) -> list[Row]:
    """Collective: the rows of one layout (against the one-rank losses, and resumed)."""
    world = dist.get_world_size()
    name = f"zero-{stage} {precision}" + (" cpu-offload" if offload else "")
    args = layout_args(stage, precision, offload, world, iters, workdir, backend)
    ck = os.path.join(workdir, name.replace(" ", "-"))
    try:
        whole, _ = train_losses([*args, "--train-iters", str(iters)])
        first, _ = train_losses([*args, "--train-iters", str(iters), "--save", ck,
                                 "--exit-interval", str(iters // 2)])
        rest, _ = train_losses([*args, "--train-iters", str(iters), "--load", ck])
    except Exception as e:  # a layout that cannot train is a failed row, not a crashed tool
        dist.barrier()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return [Row(f"{name} vs 1 rank", "FAIL", f"{type(e).__name__}: {msg[:200]}")]
    diff = max_rel_diff(whole, reference)
    tol = RTOL[precision]
    rows = [Row(f"{name} vs 1 rank", "PASS" if diff <= tol else "FAIL",
                f"{world} ranks: {len(whole)} losses, max rel diff {diff:.1e} "
                f"({'<=' if diff <= tol else '>'} {tol:g}); last {whole.get(iters, 0.0):.6f}")]
    resumed = {**first, **rest}
    diff = max_rel_diff(resumed, whole)
    tol = RESUME_RTOL[precision]
    rows.append(Row(f"{name} save+resume", "PASS" if diff <= tol else "FAIL",
                    f"saved at {min(rest) - 1 if rest else '?'}, resumed losses "
                    f"{sorted(rest)} vs uninterrupted: max rel diff {diff:.1e} "
                    f"({'<=' if diff <= tol else '>'} {tol:g})"))
    return rows


def _reference_env(device: torch.device) -> dict[str, str]:
    """The environment of a world of one on this rank's device: no launcher variables."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "MASTER_ADDR", "MASTER_PORT")
    prefixes = ("SLURM_", "OMPI_", "MV2_", "PMI_", "PMIX_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(prefixes)}
    if device.type == "cuda":
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        index = device.index or 0
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if len(visible) > index else str(index)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def start_reference(precisions: list[str], iters: int, world: int, workdir: str,
                    backend: str, device: torch.device) -> Any:
    """Rank 0 starts the one-rank run (a subprocess: its own world of one), which trains while
    the collective rows run: ``((process, its log), output path)``; None on other ranks."""
    if dist.get_rank() != 0:
        return None
    out = os.path.join(workdir, "reference.json")
    cmd = [sys.executable, "-m", "megazero.cluster_check.reference", "--out", out,
           "--iters", str(iters), "--world", str(world), "--backend", backend,
           "--precisions", ",".join(precisions)]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=_reference_env(device), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    return (proc, log), out


def finish_reference(started: Any, timeout: float) -> tuple[dict[str, dict[int, float]], str]:
    """Collective: rank 0 waits for the one-rank run and shares its losses (empty with an
    error message if it failed)."""
    box: list[Any] = [None]
    if started is not None:
        (proc, log), out = started
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.seek(0)
        text = log.read()
        if code == 0:
            with open(out, encoding="utf-8") as f:
                box[0] = ({p: {int(k): v for k, v in d.items()} for p, d in json.load(f).items()},
                          "")
        else:
            box[0] = ({}, f"the one-rank run failed ({code}): {text.strip()[-300:]}")
    dist.broadcast_object_list(box, src=0)
    return box[0]
