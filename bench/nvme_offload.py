"""NVMe optimizer offload (ZeRO-Infinity) against the disk it runs on and against CPU offload.

One process holds a CPU-offload and an NVMe-offload engine (``--params`` elements of fp32
linear layers, ZeRO stage 1, one rank, swap files under ``--nvme-path``, default the system
temp dir) and runs ``--rounds`` rounds; each round measures, in turn:

1. Raw sequential disk speed: one ``--raw-gib`` file written with large (64 MiB) ``os.pwrite``
   calls and ``fsync``, then read back with ``os.pread``; again with 4 threads of 8 MiB
   requests (the swapper's shape); the faster of the two, per direction, is "raw". The file is
   opened with ``O_DIRECT`` when the file system allows it (no page cache on either side: the
   numbers are the disk's); otherwise it is written buffered, ``fsync``-ed and its cached pages
   dropped with ``posix_fadvise(DONTNEED)`` before the read, and the table says so. "Raw
   read+write" is the rate of reading then writing the same bytes, ``2 / (1/read + 1/write)``
   (the requirement's reference). "Raw duplex" reads one half of the file while writing the
   other, 4 requests in flight each way, as the swap pipeline does: a disk that serves both
   directions at once moves more than "raw read+write" this way.
2. The update alone: the step's work on every sub-group (gradient staging, the torch update,
   the master -> model copy) over the swapper's host slots with no I/O, with the engine's
   kernel (fused on host masters) and with torch's foreach kernel. It is given in
   I/O-equivalent GB/s: the bytes the step swaps (3 states x 4 B, read and written: 24 B per
   element) over the update's time, so that it compares directly with the disk.
3. The swap pipeline alone: every sub-group read and written back through the slots, no update.
4. The NVMe optimizer step (``engine.step()``). **"I/O during the step"** is the bytes the
   swapper read plus wrote in that step over the wall time of its stream (from the first read
   issued to the last write completed: the whole of ``MasterParams.step``, which is all the
   step does with NVMe offload apart from the gradient norm); it is also given over the whole
   ``engine.step()`` time. The fraction of the stream spent waiting on I/O says which side
   bounds the step: with perfect overlap the stream takes max(update, pipeline) and the rate
   is at most min(update rate, pipeline rate).
5. The CPU-offload step on the same model.
The 1-minute load average is sampled before and after each round (the development machine's
2 cores are shared); the table gives the median and [min-max] over the rounds.

Peak host memory: each configuration then runs in its own process and reports ``VmRSS`` after
building the engine and ``VmHWM`` (``/proc/self/status``) over ``--steps`` training steps (the
peak is restarted after the build by writing 5 to ``/proc/self/clear_refs``) and over the whole
run; against the optimizer-state bytes (12 per parameter: fp32 master, exp_avg, exp_avg_sq).
Both runs also hold the model (fp32 parameters and the flat gradient buffer: it is a CPU run).

Target: I/O during the step >= 70% of the raw read+write rate.

    python bench/nvme_offload.py [--nvme-path DIR] [--params 50e6] [--raw-gib 1] [--rounds 5]
        [--sub-group-size 4e6] [--buffer-count 15] [--queue-depth 4]

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
    flight (1 thread: one plain stream of pwrite / pread). With several threads, then
    "duplex": the first half read while the second half is written, ``threads`` requests in
    flight each way (what the swap pipeline does), bytes read + written over the time."""
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
    pool = ThreadPoolExecutor(2 * threads)

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
        duplex_s = None
        if threads > 1:
            half = len(offsets) // 2
            wbufs = [_aligned(chunk) for _ in range(threads)]
            t = time.perf_counter()
            futs = [pool.submit(os.preadv, fd, [bufs[i % threads]], offsets[i])
                    for i in range(half)]
            futs += [pool.submit(os.pwrite, fd, wbufs[i % threads], offsets[half + i])
                     for i in range(half)]
            for f in futs:
                f.result()
            os.fsync(fd)
            duplex_s = time.perf_counter() - t
    finally:
        pool.shutdown()
        os.close(fd)
        os.remove(path)
    return {"bytes": nbytes, "o_direct": direct, "threads": threads, "chunk": chunk,
            "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9,
            "duplex_GBps": None if duplex_s is None
            else 2 * half * chunk / duplex_s / 1e9}


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


def _engine(device: str, params: int, nvme_path: str, sub_group: int, buffers: int,
            queue_depth: int = 4):
    from megazero.config import (
        AioConfig,
        OffloadConfig,
        OptimizerConfig,
        PrecisionConfig,
        ZeroConfig,
    )
    from megazero.config.layout import ParallelLayout
    from megazero.distributed.topology import ParallelTopology
    from megazero.zero import build_zero_optimizer

    model = _model(params)
    off = (OffloadConfig(device="cpu") if device == "cpu" else
           OffloadConfig(device="nvme", nvme_path=nvme_path, buffer_count=buffers))
    zero = ZeroConfig(stage=1, sub_group_size=sub_group, offload_optimizer=off,
                      aio=AioConfig(block_size=8 << 20, queue_depth=queue_depth))
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


def _stream_rate(swap) -> float:
    """GB/s the last stream moved: bytes read + written over its wall time."""
    st = swap.last_stream
    return (st["bytes_read"] + st["bytes_written"]) / st["seconds"] / 1e9


def _set_kernel(optimizer, kernel: str) -> None:
    """Switch the torch optimizer between its fused and foreach update (same state)."""
    for g in optimizer.param_groups:
        g["fused"], g["foreach"] = kernel == "fused", kernel == "foreach"


def run_case(device: str, params: int, steps: int, nvme_path: str, sub_group: int,
             buffers: int, queue_depth: int, queue: mp.Queue) -> None:
    """One configuration alone in this process: its peak RSS."""
    torch.set_num_threads(2)
    model, engine = _engine(device, params, nvme_path, sub_group, buffers, queue_depth)
    n = sum(p.numel() for p in model.parameters())
    built_hwm, built_rss, reset = _vm("VmHWM"), _vm("VmRSS"), _reset_hwm()
    times = [_timed_step(model, engine) for _ in range(steps + 1)]
    out = {"device": device, "params": n, "step_s_alone": statistics.median(times[1:]),
           "vm_hwm_bytes": max(built_hwm, _vm("VmHWM")), "build_hwm_bytes": built_hwm,
           "build_rss_bytes": built_rss, "steps_hwm_bytes": _vm("VmHWM") if reset else None,
           "state_bytes": 12 * n, "update_kernel": _kernel(engine)}
    swap = engine.masters.swap
    if swap is not None:
        out.update(buffer_bytes=swap.allocated_bytes, sub_groups=len(swap.numels),
                   slots=len(swap.slots), file_bytes=3 * swap.file_bytes)
    queue.put(out)


def _kernel(engine) -> str:
    d = engine.masters.optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "single-tensor"


def run_rounds(params: int, rounds: int, nvme_path: str, sub_group: int, buffers: int,
               queue_depth: int, raw_bytes: int, queue: mp.Queue) -> None:
    """Both engines in one process; every round measures, in turn: the raw disk, the NVMe
    engine's update alone (fused, then foreach), its swap pipeline alone, its full step, and
    the CPU-offload step. Interleaving puts the load of other jobs on every measurement alike;
    the load average is sampled around each round."""
    torch.set_num_threads(2)
    engines = {d: _engine(d, params, nvme_path, sub_group, buffers, queue_depth)
               for d in ("cpu", "nvme")}
    for model, engine in engines.values():
        _timed_step(model, engine)  # warm-up: first-step state, staging buffers, file pages
    model, engine = engines["nvme"]
    masters, swap = engine.masters, engine.masters.swap
    kernel = _kernel(engine)

    def update(g, master, m, v):  # the step's work on one sub-group, as MasterParams.step
        masters._bind(g, master, m, v)
        masters._step_group(masters.sub_groups[g], 1.0)
        masters._collect(g, master, m, v)

    moved = 2 * 3 * swap.file_bytes  # three files (master, exp_avg, exp_avg_sq) read + written
    rows = []
    for _ in range(rounds):
        row = {"load_before": os.getloadavg()[0]}
        raws = [raw_disk(nvme_path, raw_bytes), raw_disk(nvme_path, raw_bytes, 4, 8 << 20)]
        row.update(raw_write_GBps=max(r["write_GBps"] for r in raws),
                   raw_read_GBps=max(r["read_GBps"] for r in raws),
                   raw_duplex_GBps=raws[1]["duplex_GBps"],
                   o_direct=all(r["o_direct"] for r in raws))
        for k in ("fused", "foreach"):
            _set_kernel(masters.optimizer, k)
            t = time.perf_counter()
            swap.stream(update, read=False, write=False)
            row[f"update_{k}_s"] = time.perf_counter() - t
            row[f"update_{k}_GBps"] = moved / row[f"update_{k}_s"] / 1e9
        _set_kernel(masters.optimizer, kernel)
        swap.stream(lambda g, m, a, v: None)
        row["pipeline_only_GBps"] = _stream_rate(swap)
        row["nvme_step_s"] = _timed_step(model, engine)
        st = swap.last_stream
        row.update(step_io_GBps=_stream_rate(swap), swap_s=st["seconds"],
                   io_wait_fraction=st["io_wait_seconds"] / st["seconds"],
                   step_io_whole_step_GBps=(st["bytes_read"] + st["bytes_written"])
                   / row["nvme_step_s"] / 1e9)
        row["cpu_step_s"] = _timed_step(*engines["cpu"])
        row["load_after"] = os.getloadavg()[0]
        row["raw_read_write_GBps"] = 2 / (1 / row["raw_read_GBps"] + 1 / row["raw_write_GBps"])
        row["step_io_fraction_of_raw"] = row["step_io_GBps"] / row["raw_read_write_GBps"]
        row["step_io_fraction_of_duplex"] = row["step_io_GBps"] / row["raw_duplex_GBps"]
        rows.append(row)
    queue.put({"rounds": rows, "update_kernel": kernel, "bytes_per_step": moved})


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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
    ap.add_argument("--raw-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps of the peak-memory runs")
    ap.add_argument("--sub-group-size", type=float, default=4e6)
    ap.add_argument("--buffer-count", type=int, default=15,
                    help="5 slots: 3 sub-groups read ahead, 1 written behind")
    ap.add_argument("--queue-depth", type=int, default=4, help="aio.queue_depth (threads)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="megazero-nvme-bench-", dir=args.nvme_path)
    size = int(args.raw_gib * 2**30) // CHUNK * CHUNK
    common = (int(args.params), work, int(args.sub_group_size), args.buffer_count,
              args.queue_depth)
    rounds = _in_process(int(args.params), args.rounds, work, int(args.sub_group_size),
                         args.buffer_count, args.queue_depth, size, target=run_rounds)
    cpu = _in_process("cpu", common[0], args.steps, *common[1:])
    nvme = _in_process("nvme", common[0], args.steps, *common[1:])
    os.rmdir(work) if not os.listdir(work) else None
    rows = rounds["rounds"]
    keys = [k for k in rows[0] if k != "o_direct"]
    summary = {k: _stats([r[k] for r in rows]) for k in keys}
    res = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "nvme_path": args.nvme_path, "params": nvme["params"],
           "sub_group_size": int(args.sub_group_size), "buffer_count": args.buffer_count,
           "queue_depth": args.queue_depth,
           "update_kernel": rounds["update_kernel"], "bytes_per_step": rounds["bytes_per_step"],
           "o_direct": all(r["o_direct"] for r in rows), "summary": summary,
           "rounds": rows, "cpu_offload": cpu, "nvme_offload": nvme}
    gb = 1e9

    def m(key, scale=1.0, fmt=".2f"):
        s = summary[key]
        return (f"{s['median'] * scale:{fmt}} [{s['min'] * scale:{fmt}}-"
                f"{s['max'] * scale:{fmt}}]")

    table = [
        ("raw disk write / read GB/s" + ("" if res["o_direct"] else " (buffered, fadvise)"),
         f"{m('raw_write_GBps')} / {m('raw_read_GBps')}"),
        ("raw read+write of the same bytes GB/s", m("raw_read_write_GBps")),
        ("raw duplex (read and write at once) GB/s", m("raw_duplex_GBps")),
        ("optimizer state (12 B/param) GB", f"{nvme['state_bytes'] / gb:.2f}"),
        ("nvme: sub-groups, slots, host buffer GB",
         f"{nvme['sub_groups']}, {nvme['slots']}, {nvme['buffer_bytes'] / gb:.3f}"),
        (f"update alone, {rounds['update_kernel']} (I/O-equivalent GB/s)",
         m("update_fused_GBps")),
        ("update alone, foreach (I/O-equivalent GB/s)", m("update_foreach_GBps")),
        ("swap pipeline alone, no update GB/s", m("pipeline_only_GBps")),
        ("nvme step: I/O GB/s over the swap stream", m("step_io_GBps")),
        ("nvme step: I/O over raw read+write %", m("step_io_fraction_of_raw", 100, ".0f")),
        ("nvme step: I/O over raw duplex %", m("step_io_fraction_of_duplex", 100, ".0f")),
        ("nvme step: I/O GB/s over the whole step", m("step_io_whole_step_GBps")),
        ("nvme step: time waiting on I/O %", m("io_wait_fraction", 100, ".0f")),
        ("step time cpu / nvme s", f"{m('cpu_step_s')} / {m('nvme_step_s')}"),
        ("load average (1 min) before / after", f"{m('load_before')} / {m('load_after')}"),
        ("RSS after build cpu / nvme GB",
         f"{cpu['build_rss_bytes'] / gb:.2f} / {nvme['build_rss_bytes'] / gb:.2f}"),
        ("peak RSS during the steps cpu / nvme GB",
         " / ".join(f"{(r['steps_hwm_bytes'] or -gb) / gb:.2f}" for r in (cpu, nvme))),
        ("peak RSS (VmHWM) whole run cpu / nvme GB",
         f"{cpu['vm_hwm_bytes'] / gb:.2f} / {nvme['vm_hwm_bytes'] / gb:.2f}"),
    ]
    w = max(len(r[0]) for r in table)
    print(f"NVMe optimizer offload, {nvme['params'] / 1e6:.0f}M params, stage 1, 1 rank, "
          f"path {args.nvme_path}; median [min-max] of {len(rows)} rounds")
    for k, v in table:
        print(f"  {k:<{w}}  {v}")
    out = Path(__file__).parent / "results" / "nvme_offload.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
