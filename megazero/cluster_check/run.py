"""Run every row of :mod:`megazero.cluster_check` in order and print the table (rank 0)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero.cluster_check import Row, exit_code, format_table
from megazero.cluster_check.bandwidth import collective_rows, job_sizes, nominal_gbps
from megazero.cluster_check.binding import binding_row
from megazero.cluster_check.per_rank import SLOW_FACTOR, per_rank_rows
from megazero.cluster_check.training_rows import finish_reference, layout_rows, start_reference
from megazero.distributed.topology import ParallelTopology


@dataclass
class Options:
    """What ``tools/check_cluster.py`` parsed; None picks the default for the device kind."""

    tp: int = 1
    pp: int = 1
    sizes_mb: list[float] | None = None
    hidden_size: int | None = None
    seq_length: int | None = None
    micro_batch_size: int | None = None
    ddp_bucket_size: int | None = None
    nominal_gbps: float | None = None
    min_fraction: float = 0.5
    bandwidth_iters: int | None = None
    train_iters: int = 4
    stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    precisions: list[str] | None = None
    offload: bool = True
    collectives: bool = True
    per_rank: bool = True
    slow_factor: float = SLOW_FACTOR
    training: bool = True
    workdir: str = "check_cluster.tmp"
    backend: str | None = None
    timeout_minutes: float = 10.0


def run_checks(opts: Options) -> tuple[list[Row], list[str]]:
    """Collective: every row, and the per-rank binding lines (the same on every rank)."""
    from megazero.distributed.startup import initialize_distributed

    env = initialize_distributed(opts.backend, opts.timeout_minutes)
    device = env.device
    backend = str(dist.get_backend())
    gpu = device.type == "cuda"
    precisions = opts.precisions or (["bf16", "fp16"] if gpu else ["fp32"])
    box: list[object] = [None]
    if dist.get_rank() == 0:
        os.makedirs(opts.workdir, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix="run-", dir=opts.workdir)
    dist.broadcast_object_list(box, src=0)
    workdir = str(box[0])
    started = None
    if opts.training:
        started = start_reference(precisions, opts.train_iters, dist.get_world_size(), workdir,
                                  backend, device)
    rows: list[Row] = []
    try:
        row, lines = binding_row(device)
        rows.append(row)
        if opts.collectives:
            base = [int(mb * 2**20) for mb in (opts.sizes_mb or ([8, 64, 256] if gpu else [1, 4]))]
            sizes = job_sizes(base, opts.hidden_size, opts.seq_length, opts.micro_batch_size,
                              opts.ddp_bucket_size)
            name = torch.cuda.get_device_name(device) if gpu else None

            def nominal(nodes: int) -> float | None:
                return opts.nominal_gbps if opts.nominal_gbps is not None else (
                    nominal_gbps(name, nodes))

            topo = ParallelTopology.build(tp=opts.tp, pp=opts.pp)
            rows += collective_rows(topo, sizes, device, nominal, opts.min_fraction,
                                    opts.bandwidth_iters or (10 if gpu else 3))
        if opts.per_rank:
            rows += per_rank_rows(device, (64 if gpu else 1) * 2**20, opts.slow_factor)
        if opts.training:
            reference, error = finish_reference(started, 60 * opts.timeout_minutes)
            if error:
                rows.append(Row("one-rank reference run", "FAIL", error))
            else:
                layouts = [(s, p, False) for p in precisions for s in opts.stages]
                if opts.offload:
                    layouts.append((2, precisions[0], True))
                for stage, precision, offload in layouts:
                    rows += layout_rows(stage, precision, offload, reference[precision],
                                        opts.train_iters, workdir, backend)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(workdir, ignore_errors=True)
            if not os.listdir(opts.workdir):
                os.rmdir(opts.workdir)
    return rows, lines


def main(opts: Options) -> int:
    from megazero.distributed.startup import destroy

    rows, lines = run_checks(opts)
    if dist.get_rank() == 0:
        print("device binding, per rank:", *lines, sep="\n")
        print(format_table(rows), flush=True)
    destroy(orderly=True)  # every rank passed run_checks' last barrier
    return exit_code(rows)
