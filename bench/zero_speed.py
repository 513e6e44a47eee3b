"""Step time of ZeRO stages 0, 1, 2, 3, 2+offload, 3+offload at dp 2 on gloo, against a plain
single-process PyTorch loop of the same model (the limit) and, when available, DeepSpeed.

Model: GPT, vocab 4096, hidden 256, 4 layers, 4 heads, seq 128, micro-batch 4 per rank (global
batch 8), fp32, AdamW, clipping 1.0, dropout 0, one intra-op thread per rank.

megazero runs through the training entry point (``--driver entry``, the default): per stage one
``torchrun --nproc_per_node 2 pretrain_gpt.py --mock-data ...`` launch with a DeepSpeed JSON
selecting the stage, ``--log-interval 1 --log-json``, evaluation off. The step time is the
``iteration-time`` of every logged iteration after the first ``--warmup`` (stage 3 records its
execution order on the first step); it covers the whole iteration (schedule, gradient sync,
optimizer, scheduler, loss all-reduce) and not the logging after it, whose cost is measured
separately. ``--driver engine`` instead drives the ZeRO engine and GPTModel directly, all
cases in one world of 2 ranks.

The plain loop runs on both ranks at once, each an independent single-process loop with no
communication: the same per-process work and the same competition for cores as a data-parallel
rank, i.e. the limit a rank can reach on this machine. DeepSpeed 0.19.8 runs the same model
(megazero's GPTModel, tp = 1) and the same settings when ``MEGAZERO_DEEPSPEED_PYTHON`` names a
Python with DeepSpeed installed (each case a 2-process torchrun launch); otherwise its column
says so.

The load of a shared machine drifts over seconds (runs of slow steps, forward passes 30-40%
slower for a while), so with the entry driver every case is measured as a triplet of adjacent
launches: the plain loop (followed by the collectives), the megazero launch in the middle, and
DeepSpeed; the triplet runs forwards in one round and backwards in the next, and the cases
rotate. A case's floor is the plain loop and the collectives measured next to it, i.e. in the
same minutes; the ``plain`` row pools every plain launch. Reported: median [min-max] ms/step of
rank 0 and the median of each launch (its steps share that launch's machine state: the
launches, not the steps, are the independent samples, and a few slow launches can decide a
row's median).

ZeRO settings: ``overlap_comm`` on, ``reduce_bucket_size`` 1e6 (four buckets for this 4.2M model),
other keys at DeepSpeed defaults.

A stage's floor is compute (the plain loop) + the stage's minimal collectives, each at the
fastest implementation the stage can use on this machine (:data:`FLOOR_CHOICES`): gloo's
(all-reduce, reduce-scatter native / as all-to-all / as an all-reduce keeping one's half,
all-gather) or megazero's shared-memory ones (:mod:`megazero.distributed.shm_collectives`), which
work on buffers that persist: stage 0-1 gradients, stage 1-2 parameters. All are timed in the run.

    python bench/zero_speed.py [--driver entry|engine] [--rounds 6] [--steps 6] [--warmup 2]

Prints the table and writes bench/results/zero_speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megazero.config import (
    LoggingConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
)
from megazero.distributed.collectives import reduce_scatter
from megazero.distributed.compat import all_gather_into_tensor
from megazero.distributed.group_comm import CommLog, GroupComm
from megazero.distributed.host_allocator import keep_freed_host_memory
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.observability.monitor import Monitor
from megazero.testing import run_distributed
from megazero.testing.reference import torch_adamw
from megazero.zero import build_zero_optimizer

MBS, DP = 4, 2
OPT = OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0)
CPU = OffloadConfig(device="cpu")
ZERO_COMMON = dict(overlap_comm=True, reduce_bucket_size=1_000_000)
CASES: list[tuple[str, dict[str, Any] | None]] = [
    ("plain", None),
    ("0", dict(stage=0)),
    ("1", dict(stage=1)),
    ("2", dict(stage=2)),
    ("3", dict(stage=3)),
    ("2+offload", dict(stage=2, offload_optimizer=CPU)),
    ("3+offload", dict(stage=3, offload_optimizer=CPU, offload_param=CPU)),
]


def model_config() -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                       vocab_size=4096, attention_dropout=0.0, hidden_dropout=0.0)


def make_step(case: dict[str, Any] | None, topo: ParallelTopology) -> Callable[[Any], float]:
    """One training step function for a case (``--driver engine``): returns the loss."""
    cfg = model_config()
    if case is None:
        model = GPTModel(cfg, ParallelTopology.single())
        opt = torch_adamw(model, OPT)

        def plain(batch: Any) -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(*batch).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad)
            opt.step()
            return loss.item()
        return plain
    model = GPTModel(cfg, topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(**{**ZERO_COMMON, **case}),
                                  PrecisionConfig(), topo)

    def zero(batch: Any) -> float:
        engine.zero_grad()
        loss = model(*batch).mean()
        engine.backward(loss)
        engine.finish_grad_sync()
        engine.step()
        return loss.item()
    return zero


def _speed_world(rank: int, world_size: int, rounds: int, steps: int, rotate: int = 0,
                 names: tuple[str, ...] | None = None, tuned_allocator: bool = True,
                 collectives: bool = True) -> dict[str, list[float]]:
    if tuned_allocator:  # as pretrain_gpt.py does on the CPU
        keep_freed_host_memory()
    topo = ParallelTopology.build()
    cfg = model_config()
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (MBS, cfg.seq_length), generator=g)
    batch = (tokens, torch.roll(tokens, -1, 1))
    cases = [(n, c) for n, c in CASES if names is None or n in names]
    fns = {name: make_step(case, topo) for name, case in cases}
    for fn in fns.values():  # warm-up (stage 3 records its execution order on the first step)
        fn(batch)
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for r in range(rounds):
        k = (r + rotate) % len(cases)
        order = cases[k:] + cases[:k]  # rotate: alternating runs
        for name, _case in order:
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                fns[name](batch)
                times[name].append(1000 * (time.perf_counter() - t0))
    if collectives:
        numel = sum(p.numel() for p in GPTModel(cfg, topo).parameters())
        times.update(collective_times(topo, numel, rounds * steps))
        if "plain" in fns:
            coll = {k[5:]: statistics.median(v) for k, v in times.items()
                    if k.startswith("coll:")}
            times.update(floor_loop_times(topo, fns["plain"], batch, numel, rounds * steps,
                                          coll))
    dist.barrier()
    return times


BUCKET = int(ZERO_COMMON["reduce_bucket_size"])
UNTUNED = "plain, glibc malloc defaults"


def bucket_buffers(numel: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``numel`` elements cut into buckets of ``reduce_bucket_size`` padded to a multiple of dp,
    as the engine cuts its flat buffer: each bucket and its 1/dp shard."""
    sizes = [min(BUCKET, numel - lo) for lo in range(0, numel, BUCKET)]
    sizes = [-(-k // DP) * DP for k in sizes]
    return [torch.randn(k) for k in sizes], [torch.empty(k // DP) for k in sizes]


def issue_all(op: str, bufs: list[torch.Tensor], outs: list[torch.Tensor], group: Any,
              rs_impl: str = "native") -> None:
    """One collective over every bucket, all in flight at once (as the engine issues them),
    then wait: ``all_reduce`` of the buckets, ``reduce_scatter`` of the buckets into their
    shards (``rs_impl`` as in :func:`megazero.distributed.collectives.reduce_scatter`), or
    ``all_gather`` of the shards into the buckets."""
    if op == "all_reduce":
        works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs]
    elif op == "reduce_scatter":
        works = [reduce_scatter(o, b, group, rs_impl, async_op=True) for o, b in zip(outs, bufs)]
    else:
        works = [all_gather_into_tensor(b, o, group=group, async_op=True)
                 for o, b in zip(outs, bufs)]
    for w in works:
        w.wait()


SharedBuckets = tuple[GroupComm, list[torch.Tensor]]


def shared_buckets(topo: ParallelTopology, numel: int) -> SharedBuckets | None:
    """A data-parallel :class:`GroupComm`'s shared-memory buffer cut into the buckets of
    :func:`bucket_buffers` (``None`` where the group cannot use shared memory)."""
    comm = GroupComm(topo.dp_group, "dp", CommLog())
    sizes = [b.numel() for b in bucket_buffers(numel)[0]]
    flat = comm.shared_buffer(sum(sizes), torch.float32, torch.device("cpu"))
    if not comm.is_shared(flat):
        return None
    flat.copy_(torch.randn(flat.numel()))
    return comm, list(flat.split(sizes))


def issue_shared(op: str, shm: SharedBuckets) -> None:
    """One shared-memory collective over every bucket, issued as the engine issues them, then
    waited for (the first wait runs them all): ``all_reduce`` (averaged, stage 0),
    ``reduce_scatter`` (averaged, in place: stage 1's gradients), ``all_gather`` (in place:
    the parameters of stages 1-2)."""
    comm, views = shm
    if op == "all_reduce":
        works = [comm.all_reduce(v, async_op=True, average=True) for v in views]
    elif op == "reduce_scatter":
        works = [comm.reduce_scatter_in_place(v, async_op=True, average=True) for v in views]
    else:
        works = [comm.all_gather_in_place(v, async_op=True) for v in views]
    for w in works:
        w.wait()


def collective_times(topo: ParallelTopology, numel: int, n: int) -> dict[str, list[float]]:
    """ms per step of each collective the stages need, over the model's fp32 parameter count in
    buckets of ``reduce_bucket_size`` all in flight at once (as the engine issues them):
    gloo's ``all_reduce`` (also a reduce-scatter that keeps its own half), ``reduce_scatter``
    (gloo's own), ``reduce_scatter_a2a`` (all-to-all + local sum, what megazero uses on gloo)
    and ``all_gather``; and megazero's shared-memory ``all_reduce_shm``,
    ``reduce_scatter_shm`` and ``all_gather_shm`` where the group can use them. Rounds
    alternate the collectives."""
    bufs, outs = bucket_buffers(numel)
    g = topo.dp_group
    shm = shared_buckets(topo, numel)
    fns = {"all_reduce": lambda: issue_all("all_reduce", bufs, outs, g),
           "reduce_scatter": lambda: issue_all("reduce_scatter", bufs, outs, g, "native"),
           "reduce_scatter_a2a": lambda: issue_all("reduce_scatter", bufs, outs, g,
                                                   "all_to_all"),
           "all_gather": lambda: issue_all("all_gather", bufs, outs, g)}
    if shm is not None:
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            fns[f"{op}_shm"] = lambda op=op: issue_shared(op, shm)
    out: dict[str, list[float]] = {f"coll:{k}": [] for k in fns}
    for f in fns.values():  # warm-up
        f()
    for _ in range(n):
        for k, f in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            f()
            out[f"coll:{k}"].append(1000 * (time.perf_counter() - t0))
    return out


#: Per stage, which implementations of its minimal collectives (in the order a step issues
#: them) it can use: the shared-memory ones need the buffer they work on to persist, which
#: holds for the gradients at stages 0-1 and the parameters at stages 1-2; stage 2's
#: gradients and stage 3's gathered parameters are transient (megazero has no shared-memory
#: path for them).
FLOOR_CHOICES: dict[int, tuple[tuple[str, ...], ...]] = {
    0: (("all_reduce", "all_reduce_shm"),),
    1: (("reduce_scatter", "reduce_scatter_a2a", "all_reduce", "reduce_scatter_shm",
           "all_reduce_shm"), ("all_gather", "all_gather_shm")),
    2: (("reduce_scatter", "reduce_scatter_a2a", "all_reduce"),
          ("all_gather", "all_gather_shm")),
    3: (("all_gather",), ("all_gather",),
          ("reduce_scatter", "reduce_scatter_a2a", "all_reduce")),
}


def floor_ops(coll: dict[str, float], stage: int) -> list[str]:
    """The fastest available implementation of each of the stage's minimal collectives."""
    return [min((k for k in choice if k in coll), key=lambda k: coll[k])
            for choice in FLOOR_CHOICES[stage]]


def floor_loop_times(topo: ParallelTopology, step: Callable[[Any], float], batch: Any,
                     numel: int, n: int, coll: dict[str, float]) -> dict[str, list[float]]:
    """ms per iteration of the plain loop followed, in the same iteration, by each stage's
    minimal collectives (:func:`floor_ops` of the ``coll`` medians measured just before,
    buckets as in :func:`collective_times`), with no barrier in between: the simplest
    synchronous data-parallel loop. Unlike the sum of separately measured medians it includes
    what every synchronous step pays and a barrier hides: the ranks arrive at the collective at
    different times (the median of the sum is not the sum of the medians)."""
    bufs, outs = bucket_buffers(numel)
    shm = shared_buckets(topo, numel)

    def issue(name: str) -> None:
        if name.endswith("_shm"):
            assert shm is not None
            issue_shared(name[:-4], shm)
        elif name == "reduce_scatter_a2a":
            issue_all("reduce_scatter", bufs, outs, topo.dp_group, "all_to_all")
        else:
            issue_all(name, bufs, outs, topo.dp_group, "native")

    patterns = {k: floor_ops(coll, k) for k in FLOOR_CHOICES}
    out: dict[str, list[float]] = {f"floor:{k}": [] for k in patterns}
    dist.barrier()
    for i in range(n + 1):  # the first round warms the pattern up
        for k, ops in patterns.items():
            t0 = time.perf_counter()
            step(batch)
            for op in ops:
                issue(op)
            if i:
                out[f"floor:{k}"].append(1000 * (time.perf_counter() - t0))
    return out


def floor_ms(plain: float, coll: dict[str, float], stage: int) -> tuple[float, str]:
    """Compute + the stage's minimal collectives, each the fastest implementation the stage can
    use on this machine (:data:`FLOOR_CHOICES`): stage 0 one all-reduce; 1 and 2 a
    reduce-scatter (or an all-reduce keeping one's half) and an all-gather of the parameters;
    3 two all-gathers (forward and backward) and a reduce-scatter."""
    ops = floor_ops(coll, stage)
    return plain + sum(coll[k] for k in ops), " + ".join(ops)


DS_SCRIPT = r'''
import json, os, statistics, sys, time
sys.path.insert(0, os.environ["MEGAZERO_ROOT"])
import torch, deepspeed
from megazero.model.gpt import GPTModel
from megazero.distributed.topology import ParallelTopology
sys.path.insert(0, os.path.join(os.environ["MEGAZERO_ROOT"], "bench"))
from zero_speed import OPT, MBS, ZERO_COMMON, model_config, ds_zero_block
stage, offload, steps = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
cfg = model_config()
model = GPTModel(cfg, ParallelTopology.single())
decay = [p for p in model.parameters() if p.ndim >= 2]
rest = [p for p in model.parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=OPT.lr,
                        weight_decay=OPT.weight_decay)
ds = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1,
      "gradient_clipping": OPT.clip_grad, "zero_allow_untested_optimizer": True,
      "zero_force_ds_cpu_optimizer": False, "zero_optimization": ds_zero_block(stage, offload)}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
g = torch.Generator().manual_seed(rank)
tokens = torch.randint(0, cfg.vocab_size, (MBS, cfg.seq_length), generator=g)
labels = torch.roll(tokens, -1, 1)
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    loss = engine(tokens, labels).mean()
    engine.backward(loss)
    engine.step()
    if i:
        times.append(1000 * (time.perf_counter() - t0))
if rank == 0:
    print("MEGAZERO_DS_RESULT " + json.dumps(times), flush=True)
'''


def ds_zero_block(stage: int, offload: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"stage": stage, **ZERO_COMMON}
    if offload:
        block["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            block["offload_param"] = {"device": "cpu"}
    return block


def run_deepspeed(python: str, steps: int, cases: list[tuple[str, dict[str, Any] | None]]
                  ) -> dict[str, list[float] | str]:
    """Each DeepSpeed case in its own 2-process torchrun launch (DeepSpeed keeps global state)."""
    out: dict[str, list[float] | str] = {}
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "ds_step.py")
        with open(script, "w") as f:
            f.write(DS_SCRIPT)
        env = {**os.environ, "MEGAZERO_ROOT": root, "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": "1"}
        for name, case in cases:
            if case is None:
                continue
            offload = "offload" in name
            cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(DP),
                   "--master_port", str(29700 + len(out)), script, str(case["stage"]),
                   "1" if offload else "0", str(steps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEGAZERO_DS_RESULT")]
            if lines:
                out[name] = json.loads(lines[-1].split(" ", 1)[1])
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                out[name] = "failed: " + " | ".join(tail)
    return out



ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def entry_args(steps: int, ds_config: str, log_json: str) -> list[str]:
    """``pretrain_gpt.py`` and its flags: this bench's model, mock data, evaluation off."""
    m, o = model_config(), OPT
    return ["pretrain_gpt.py", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(m.vocab_size), "--hidden-size", str(m.hidden_size),
            "--num-layers", str(m.num_layers), "--num-attention-heads",
            str(m.num_attention_heads), "--seq-length", str(m.seq_length),
            "--max-position-embeddings", str(m.seq_length), "--micro-batch-size", str(MBS),
            "--global-batch-size", str(MBS * DP), "--attention-dropout", "0",
            "--hidden-dropout", "0", "--lr", str(o.lr), "--lr-decay-style", "constant",
            "--weight-decay", str(o.weight_decay), "--clip-grad", str(o.clip_grad),
            "--train-iters", str(steps), "--eval-iters", "0", "--log-interval", "1",
            "--log-json", log_json, "--deepspeed_config", ds_config]


def entry_ds_config(case: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed JSON of one megazero case; ``wall_clock_breakdown`` adds per-phase times
    to the log (a few clock reads per iteration)."""
    offload = "offload_optimizer" in case
    return {"wall_clock_breakdown": True,
            "zero_optimization": ds_zero_block(case["stage"], offload)}


def run_entry(name: str, case: dict[str, Any], steps: int, warmup: int, port: int
              ) -> dict[str, Any]:
    """One torchrun launch of pretrain_gpt.py; per-iteration ms after ``warmup`` iterations."""
    slug = name.replace("+", "_")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, log = os.path.join(tmp, f"ds_{slug}.json"), os.path.join(tmp, f"{slug}.jsonl")
        with open(cfg, "w") as f:
            json.dump(entry_ds_config(case), f)
        cmd = [TORCHRUN, "--nproc_per_node", str(DP), "--master_port", str(port),
               *entry_args(warmup + steps, cfg, log)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        launch_s = time.perf_counter() - t0
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{name}: pretrain_gpt.py failed: " + " | ".join(tail))
        with open(log) as f:
            lines = [json.loads(ln) for ln in f]
    its = [x for x in lines if "iteration-time" in x and x["iteration"] > warmup]
    phases = {k[5:-3]: [x[k] for x in its] for k in its[0]
              if k.startswith("time/") and k.endswith("_ms")}
    return {"ms": [1000 * x["iteration-time"] for x in its], "phases": phases,
            "launch_s": launch_s}


def log_cost_ms(n: int = 200) -> float:
    """Wall time of one ``--log-interval 1`` report (log line + JSON line) on the reporting
    rank; it comes after the timed part of an iteration, so it adds to the run, not the field."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        mon = Monitor(LoggingConfig(log_interval=1), enabled=True,
                      log_json=os.path.join(tmp, "log.jsonl"))
        t0 = time.perf_counter()
        for i in range(n):
            mon.record(8.0, False, 0.3, {"forward": 0.1, "optimizer": 0.1})
            mon.report(i + 1, n, 8 * (i + 1), OPT.lr, 8, 128, None, 1.0, 1e9, DP)
        dt = time.perf_counter() - t0
        mon.close()
    return 1000 * dt / n


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "device": "CPU only, gloo backend"}


def ds_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('deepspeed'))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def launch_medians(samples: list[float], steps: int) -> list[float]:
    """The median of each launch's ``steps`` consecutive samples."""
    return [statistics.median(samples[i:i + steps]) for i in range(0, len(samples), steps)]


def _add(acc: dict[str, Any], name: str, value: Any) -> None:
    """Append a case's samples; a failure message is kept only if nothing was measured."""
    if isinstance(value, list):
        prev = acc.get(name)
        acc[name] = (prev if isinstance(prev, list) else []) + value
    elif name not in acc:
        acc[name] = value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", choices=("entry", "engine"), default="entry")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per case and round")
    ap.add_argument("--warmup", type=int, default=2,
                    help="entry driver: iterations skipped per launch")
    ap.add_argument("--cases", default=",".join(n for n, c in CASES if c is not None),
                    help="comma-separated ZeRO cases to run (the plain loop always runs)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_speed.json"))
    args = ap.parse_args(argv)
    ds_python = os.environ.get("MEGAZERO_DEEPSPEED_PYTHON")
    wanted = args.cases.split(",")
    unknown = sorted(set(wanted) - {n for n, _ in CASES})
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {[n for n, _ in CASES[1:]]}")
    cases = [(n, c) for n, c in CASES if c is None or n in wanted]
    zero_cases = [(n, c) for n, c in cases if c is not None]
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    # per case: the plain loop and collectives measured next to it (entry driver)
    local: dict[str, dict[str, list[float]]] = {name: {} for name, _ in zero_cases}
    phases: dict[str, dict[str, list[float]]] = {}
    launch_s: dict[str, list[float]] = {}
    commands: dict[str, Any] = {}
    raw: dict[str, list[float] | str] = {}
    t_start = time.perf_counter()

    def plain_launch(tuned: bool = True, collectives: bool = True) -> dict[str, list[float]]:
        return run_distributed(_speed_world, DP, 1, args.steps, 0, ("plain",), tuned,
                               collectives, timeout=1800)[0]

    for r in range(args.rounds):
        times.setdefault(UNTUNED, []).extend(plain_launch(False, False)["plain"])
        if args.driver == "engine":
            got = run_distributed(_speed_world, DP, 1, args.steps, r, None, timeout=1800)[0]
            for k, v in got.items():
                times.setdefault(k, []).extend(v)
            if ds_python:
                for k, v in run_deepspeed(ds_python, args.steps, zero_cases).items():
                    _add(raw, k, v)
        else:
            k = r % len(zero_cases)
            for i, (name, case) in enumerate(zero_cases[k:] + zero_cases[:k]):
                sides = ["plain", "megazero", "deepspeed"]
                for side in sides if (r + i) % 2 == 0 else sides[::-1]:
                    if side == "plain":
                        for key, v in plain_launch().items():
                            times.setdefault(key, []).extend(v)
                            local[name].setdefault(key, []).extend(v)
                    elif side == "megazero":
                        res = run_entry(name, case, args.steps, args.warmup, 29600 + i)
                        times[name] += res["ms"]
                        launch_s.setdefault(name, []).append(res["launch_s"])
                        for ph, v in res["phases"].items():
                            phases.setdefault(name, {}).setdefault(ph, []).extend(v)
                    elif ds_python:
                        for key, v in run_deepspeed(ds_python, args.steps,
                                                    [(name, case)]).items():
                            _add(raw, key, v)
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f}s)",
              flush=True)
    if args.driver == "entry":
        iters = args.warmup + args.steps
        commands["megazero"] = " ".join(["OMP_NUM_THREADS=1", "torchrun", "--nproc_per_node",
                                         str(DP), *entry_args(iters, "ds_<case>.json",
                                                              "<case>.jsonl")])
        commands["ds_<case>.json"] = {n: entry_ds_config(c) for n, c in zero_cases}
    if ds_python:
        commands["deepspeed"] = (f"torchrun --nproc_per_node {DP} ds_step.py <stage> "
                                 f"<offload 0|1> {args.steps}  (DS_SCRIPT in this file)")
    med = {k: statistics.median(v) for k, v in times.items()}
    ds = {k: statistics.median(v) if isinstance(v, list) and v else v for k, v in raw.items()}
    ds_low = {k: min(v) for k, v in raw.items() if isinstance(v, list) and v}
    plain = med["plain"]
    coll = {k[5:]: v for k, v in med.items() if k.startswith("coll:")}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    print("collectives per step (ms, median [min-max]), buckets of "
          f"{BUCKET:.0e} elements all in flight: " + ", ".join(
              f"{k} {v:.1f} [{spread['coll:' + k][0]:.1f}-{spread['coll:' + k][1]:.1f}]"
              for k, v in coll.items()))
    print(f"GPT 4.2M (V4096 h256 L4 a4 s128 mb{MBS}) fp32 AdamW clip 1.0, dp {DP} on gloo, "
          f"megazero via {args.driver}, median of {args.rounds}x{args.steps} steps "
          "[min-max]; floor = plain loop (both ranks at once) + the stage's minimal "
          "collectives" + (", both measured next to the case" if args.driver == "entry"
                           else "") + "; loop = the plain loop issuing those collectives "
          "itself, timed as one loop (includes the ranks' skew at the collective)")
    print(f"{'case':>10} {'megazero':>22} {'floor':>7} {'vs floor':>8} {'loop':>7} "
          f"{'vs loop':>6} {'DeepSpeed':>22} {'vs DS':>6}")
    rows = []
    for name, case in cases:
        d = ds.get(name, "n/a" if name == "plain" else
                   "not run: set MEGAZERO_DEEPSPEED_PYTHON" if not ds_python else "missing")
        vs_ds = med[name] / d if isinstance(d, float) else None
        lo, hi = spread[name]
        d_txt = (f"{d:7.1f} [{ds_low[name]:5.1f}-{max(raw[name]):5.1f}] {vs_ds:6.3f}"
                 if isinstance(d, float) else f" {str(d)[:40]}")
        near = local.get(name) or {}
        near_plain = statistics.median(near["plain"]) if near.get("plain") else plain
        near_coll = ({k[5:]: statistics.median(v) for k, v in near.items()
                      if k.startswith("coll:")} or coll)
        loop_key = None if case is None else f"floor:{case['stage']}"
        loop_src = near if near.get(str(loop_key)) else times
        loop_fl = (statistics.median(loop_src[loop_key])
                   if loop_key is not None and loop_src.get(loop_key) else None)
        if case is None:
            fl, fl_ops = plain, "none"
        else:
            fl, fl_ops = floor_ms(near_plain, near_coll, case["stage"])
        loop_txt = (f"{loop_fl:7.1f} {med[name] / loop_fl:6.3f}" if loop_fl is not None
                    else f"{'':7} {'':6}")
        print(f"{name:>10} {med[name]:7.1f} [{lo:5.1f}-{hi:5.1f}] {fl:7.1f} "
              f"{med[name] / fl:8.3f} {loop_txt} {d_txt}")
        row = dict(case=name, ms_per_step=med[name], ratio_to_plain=med[name] / plain,
                   min_ms=lo, max_ms=hi, floor_ms=fl, floor_collectives=fl_ops,
                   ratio_to_floor=med[name] / fl, floor_plain_ms=near_plain,
                   loop_floor_ms=loop_fl,
                   ratio_to_loop_floor=med[name] / loop_fl if loop_fl else None,
                   floor_collectives_ms=near_coll,
                   deepspeed_ms_per_step=d, deepspeed_min_ms=ds_low.get(name),
                   deepspeed_max_ms=max(raw[name]) if isinstance(raw.get(name), list) else None,
                   ratio_to_deepspeed=vs_ds, samples=times[name],
                   deepspeed_samples=raw.get(name))
        # Per case and round (with the entry driver one launch, for the plain loop one
        # spawned world): its steps share that process's placement and machine state, so
        # these are the independent samples; their medians show whether a row was decided
        # by a few slow launches rather than by the code.
        row["launch_medians_ms"] = launch_medians(times[name], args.steps)
        if near.get("plain"):
            row["floor_plain_launch_medians_ms"] = launch_medians(near["plain"], args.steps)
        if isinstance(raw.get(name), list):
            row["deepspeed_launch_medians_ms"] = launch_medians(raw[name], args.steps)
        if name in phases:
            row["phase_median_ms"] = {k: statistics.median(v) for k, v in phases[name].items()}
            row["launch_s"] = launch_s[name]
        rows.append(row)
    print("per-launch medians (ms), in round order:")
    for row in rows:
        ds_l = row.get("deepspeed_launch_medians_ms")
        print(f"{row['case']:>10}: " + " ".join(f"{x:.0f}" for x in row["launch_medians_ms"])
              + (" | DeepSpeed " + " ".join(f"{x:.0f}" for x in ds_l) if ds_l else ""))
    lo, hi = spread[UNTUNED]
    print(f"{UNTUNED}: {med[UNTUNED]:.1f} [{lo:.1f}-{hi:.1f}] ms ({med[UNTUNED] / plain:.3f} x "
          "the plain loop with the host allocator as pretrain_gpt.py sets it on the CPU)")
    rows.append(dict(case=UNTUNED, ms_per_step=med[UNTUNED],
                     ratio_to_plain=med[UNTUNED] / plain, min_ms=lo, max_ms=hi,
                     samples=times[UNTUNED]))
    if phases:
        print("wall_clock_breakdown, median ms per iteration (loop = interval wall time per "
              "iteration, logging included):")
        for row in rows:
            ph = row.get("phase_median_ms")
            if ph:
                parts = ", ".join(f"{k} {v:.1f}" for k, v in
                                  sorted(ph.items(), key=lambda kv: -kv[1]) if v >= 0.05)
                print(f"{row['case']:>10}: {parts}")
    log_ms = log_cost_ms() if args.driver == "entry" else None
    if log_ms is not None:
        print(f"--log-interval 1 report: {log_ms:.3f} ms per iteration (outside the step time)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "collectives_ms": coll,
                   "collective_samples": {k[5:]: v for k, v in times.items()
                                          if k.startswith("coll:")},
                   "driver": args.driver, "rounds": args.rounds,
                   "steps_per_round": args.steps,
                   "warmup_iterations": args.warmup if args.driver == "entry" else 1,
                   "machine": machine(),
                   "deepspeed": ds_version(ds_python) if ds_python else None,
                   "commands": commands, "log_report_ms": log_ms,
                   "bench_seconds": time.perf_counter() - t_start,
                   "model": model_config().__dict__, "micro_batch": MBS, "dp": DP,
                   "zero": ZERO_COMMON, "threads_per_rank": 1}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
