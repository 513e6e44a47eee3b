"""NVMe optimizer offload (ZeRO-Infinity) against the disk it runs on and against CPU offload.

One run measures, on the directory given by ``--nvme-path`` (default: the system temp dir):

1. Raw sequential disk speed: one ``--raw-gib`` file written with large (64 MiB) ``os.pwrite``
   calls and ``fsync``, then read back with ``os.pread``; again with 4 threads of 8 MiB
   requests (the swapper's shape in step 2); the faster of the two, per direction, is "raw".
   The file is opened with ``O_DIRECT``
   when the file system allows it (no page cache on either side: the numbers are the disk's);
   otherwise it is written buffered, ``fsync``-ed and its cached pages dropped with
   ``posix_fadvise(DONTNEED)`` before the read (dropping the whole page cache needs root), and
   the table says so.
2. The optimizer step of a stack of fp32 linear layers (``--params`` elements, ZeRO stage 1,
   one rank) with ``offload_optimizer`` on ``cpu`` and on ``nvme`` (same directory): step time
   (median and minimum of ``--steps`` after one warm-up, both engines in one process with their
   steps alternating, so that load from other jobs hits both alike) and, for NVMe, the bytes
   read and written during the step over the step's swap time. The same swap pipeline is also
   timed with the update taken out (read + write only), which is the rate the swapper can
   sustain on its own; the 2 shared cores of the development machine make the full step
   compute-bound.
3. Peak host memory: each configuration runs in its own process and reports ``VmRSS`` after
   building the engine and ``VmHWM`` (``/proc/self/status``) over the training steps (the peak
   is restarted after the build by writing 5 to ``/proc/self/clear_refs``) and over the whole
   run; against the optimizer-state bytes (12 per parameter: fp32 master, exp_avg,
   exp_avg_sq). Both runs also hold the model (fp32 parameters and the flat gradient buffer:
   it is a CPU run) and per-sub-group gradient copies.

Target: the step moves data at >= 70% of the raw disk rate (read and write of the same bytes:
``2 / (1/read + 1/write)``).

    python bench/nvme_offload.py [--nvme-path DIR] [--params 50e6] [--raw-gib 2] [--steps 3]

Prints a table and writes bench/results/nvme_offload.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

CHUNK = 64 << 20


def _aligned(nbytes: int) -> memoryview:
    from megazero.zero.offload import aligned_host_empty

    return memoryview(aligned_host_empty(nbytes, torch.uint8, False).numpy())


def raw_disk(directory: str, nbytes: int, threads: int = 1, chunk: int = CHUNK) -> dict:
    """Write then read ``nbytes`` sequentially: ``threads`` requests of ``chunk`` bytes in
    flight (1 thread: one plain stream of pwrite / pread)."""
    from concurrent.futures import ThreadPoolExecutor

    path = os.path.join(directory, "megazero_raw_disk.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    direct = hasattr(os, "O_DIRECT")
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    except OSError:
        direct, fd = False, os.open(path, flags, 0o600)
    bufs = [_aligned(chunk) for _ in range(threads)]
    for b in bufs:
        b[:] = os.urandom(1 << 20) * (chunk >> 20)
    offsets = list(range(0, nbytes, chunk))
    pool = ThreadPoolExecutor(threads)

    def each(fn):
        list(pool.map(lambda i: fn(bufs[i % threads], offsets[i]), range(len(offsets))))

    try:
        t = time.perf_counter()
        each(lambda b, off: os.pwrite(fd, b, off))
        os.fsync(fd)
        write_s = time.perf_counter() - t
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        each(lambda b, off: os.preadv(fd, [b], off))
        read_s = time.perf_counter() - t
    finally:
        pool.shutdown()
        os.close(fd)
        os.remove(path)
    return {"bytes": nbytes, "o_direct": direct, "threads": threads, "chunk": chunk,
            "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9}


def _vm(field: str = "VmHWM") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return -1


def _reset_hwm() -> bool:
    """Restart VmHWM from the current RSS (``clear_refs`` 5, no root needed)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _model(params: int) -> nn.Module:
    width = 2048
    layers = max(1, round(params / (width * width)))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _engine(device: str, params: int, nvme_path: str, sub_group: int, buffers: int):
    from megazero.config import (
        AioConfig,
        OffloadConfig,
        OptimizerConfig,
        PrecisionConfig,
        ZeroConfig,
    )
    from megazero.topology import ParallelLayout, ParallelTopology
    from megazero.zero import build_zero_optimizer

    model = _model(params)
    off = (OffloadConfig(device="cpu") if device == "cpu" else
           OffloadConfig(device="nvme", nvme_path=nvme_path, buffer_count=buffers))
    zero = ZeroConfig(stage=1, sub_group_size=sub_group, offload_optimizer=off,
                      aio=AioConfig(block_size=8 << 20, queue_depth=4))
    engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-4), zero, PrecisionConfig(),
                                  ParallelTopology(ParallelLayout(world_size=1), rank=0))
    return model, engine


def _timed_step(model, engine) -> float:
    engine.zero_grad()
    model(torch.ones(2, 2048)).square().mean().backward()
    engine.finish_grad_sync()
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def run_case(device: str, params: int, steps: int, nvme_path: str, sub_group: int,
             buffers: int, queue: mp.Queue) -> None:
    """One configuration alone in this process: its peak RSS and (NVMe) swap I/O rates."""
    torch.set_num_threads(2)
    model, engine = _engine(device, params, nvme_path, sub_group, buffers)
    n = sum(p.numel() for p in model.parameters())
    built_hwm, built_rss, reset = _vm("VmHWM"), _vm("VmRSS"), _reset_hwm()
    times, streams = [], []
    for _ in range(steps + 1):
        times.append(_timed_step(model, engine))
        if engine.masters.swap is not None:
            streams.append(dict(engine.masters.swap.last_stream))
    out = {"device": device, "params": n, "step_s_alone": statistics.median(times[1:]),
           "vm_hwm_bytes": max(built_hwm, _vm("VmHWM")), "build_hwm_bytes": built_hwm,
           "build_rss_bytes": built_rss, "steps_hwm_bytes": _vm("VmHWM") if reset else None,
           "state_bytes": 12 * n}
    swap = engine.masters.swap
    if swap is not None:
        s = streams[1:]
        moved = statistics.median([(x["bytes_read"] + x["bytes_written"]) / x["seconds"]
                                   for x in s])
        out.update(step_io_GBps=moved / 1e9,
                   io_wait_fraction=statistics.median([x["io_wait_seconds"] / x["seconds"]
                                                       for x in s]),
                   buffer_bytes=swap.allocated_bytes, sub_groups=len(swap.numels),
                   file_bytes=3 * swap.file_bytes)
        rates = []
        for _ in range(2):  # the pipeline alone: read + write every sub-group, no update
            swap.stream(lambda g, m, a, v: None)
            st = swap.last_stream
            rates.append((st["bytes_read"] + st["bytes_written"]) / st["seconds"])
        out["pipeline_only_GBps"] = max(rates) / 1e9
    queue.put(out)


def run_interleaved(params: int, steps: int, nvme_path: str, sub_group: int, buffers: int,
                    queue: mp.Queue) -> None:
    """Both engines in one process, steps alternating: load from other jobs on the machine hits
    both alike (the machine this was written on is shared)."""
    torch.set_num_threads(2)
    engines = {d: _engine(d, params, nvme_path, sub_group, buffers) for d in ("cpu", "nvme")}
    times: dict[str, list[float]] = {d: [] for d in engines}
    for _ in range(steps + 1):
        for d, (model, engine) in engines.items():
            times[d].append(_timed_step(model, engine))
    queue.put({d: {"median_s": statistics.median(t[1:]), "min_s": min(t[1:]), "all_s": t}
               for d, t in times.items()})


def _in_process(*args, target=run_case) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    res = q.get(timeout=1800)
    p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--raw-gib", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sub-group-size", type=float, default=4e6)
    ap.add_argument("--buffer-count", type=int, default=9)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="megazero-nvme-bench-", dir=args.nvme_path)
    size = int(args.raw_gib * 2**30) // CHUNK * CHUNK
    # one stream of 64 MiB requests, and the swapper's own shape: 4 x 8 MiB in flight
    raws = [raw_disk(work, size), raw_disk(work, size, threads=4, chunk=8 << 20)]
    raw = {"write_GBps": max(r["write_GBps"] for r in raws),
           "read_GBps": max(r["read_GBps"] for r in raws),
           "o_direct": all(r["o_direct"] for r in raws), "runs": raws}
    common = (int(args.params), args.steps, work, int(args.sub_group_size), args.buffer_count)
    cpu = _in_process("cpu", *common)
    nvme = _in_process("nvme", *common)
    steps = _in_process(*common, target=run_interleaved)
    os.rmdir(work) if not os.listdir(work) else None
    both = 2 / (1 / raw["read_GBps"] + 1 / raw["write_GBps"])
    res = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "nvme_path": args.nvme_path, "raw": raw, "raw_read_write_GBps": both,
           "cpu_offload": cpu, "nvme_offload": nvme, "step_time_interleaved": steps,
           "step_io_fraction_of_raw": nvme["step_io_GBps"] / both,
           "pipeline_only_fraction_of_raw": nvme["pipeline_only_GBps"] / both}
    gb = 1e9
    rows = [
        ("raw disk write / read GB/s" + ("" if raw["o_direct"] else " (buffered, fadvise)"),
         f"{raw['write_GBps']:.2f} / {raw['read_GBps']:.2f}"),
        ("raw read+write of the same bytes GB/s", f"{both:.2f}"),
        ("optimizer state (12 B/param) GB", f"{nvme['state_bytes'] / gb:.2f}"),
        ("nvme: sub-groups, host buffer GB", f"{nvme['sub_groups']}, "
                                            f"{nvme['buffer_bytes'] / gb:.3f}"),
        ("nvme: step I/O GB/s (read+write / swap time)",
         f"{nvme['step_io_GBps']:.2f} ({100 * res['step_io_fraction_of_raw']:.0f}% of raw)"),
        ("nvme: time waiting on I/O in the step", f"{100 * nvme['io_wait_fraction']:.0f}%"),
        ("nvme: pipeline alone GB/s (no update)",
         f"{nvme['pipeline_only_GBps']:.2f} "
         f"({100 * res['pipeline_only_fraction_of_raw']:.0f}% of raw)"),
        ("step time cpu / nvme s, median (min)",
         f"{steps['cpu']['median_s']:.2f} ({steps['cpu']['min_s']:.2f}) / "
         f"{steps['nvme']['median_s']:.2f} ({steps['nvme']['min_s']:.2f})"),
        ("RSS after build cpu / nvme GB",
         f"{cpu['build_rss_bytes'] / gb:.2f} / {nvme['build_rss_bytes'] / gb:.2f}"),
        ("peak RSS during the steps cpu / nvme GB",
         " / ".join(f"{(r['steps_hwm_bytes'] or -gb) / gb:.2f}" for r in (cpu, nvme))),
        ("peak RSS (VmHWM) whole run cpu / nvme GB",
         f"{cpu['vm_hwm_bytes'] / gb:.2f} / {nvme['vm_hwm_bytes'] / gb:.2f}"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"NVMe optimizer offload, {nvme['params'] / 1e6:.0f}M params, stage 1, 1 rank, "
          f"path {args.nvme_path}")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    out = Path(__file__).parent / "results" / "nvme_offload.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
