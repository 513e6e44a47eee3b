"""Check a fresh allocation before a long job: device binding, collectives at the job's sizes
(bus bandwidth against the link's nominal figure), and a small GPT at ZeRO 0-3 (bf16 and fp16
on GPUs, fp32 on CPU, and with the optimizer offloaded to the CPU) saved and resumed, its
losses compared with one rank's. One PASS/FAIL line per check; exit status 1 on any FAIL.

    torchrun --nproc_per_node 8 tools/check_cluster.py
    srun --ntasks-per-node 8 --gpus-per-task 1 python tools/check_cluster.py   # MASTER_ADDR/PORT
    torchrun --nproc_per_node 4 tools/check_cluster.py --distributed-backend gloo   # CPU

See :mod:`megazero.cluster_check` for what each row checks.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.cluster_check.run import Options  # noqa: E402


def _list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=1,
                   help="the job's layout: its tensor-parallel groups' collectives are timed")
    p.add_argument("--pipeline-model-parallel-size", dest="pp", type=int, default=1,
                   help="the job's layout: send/recv between its pipeline neighbours")
    p.add_argument("--size", dest="sizes_mb", type=_list(float),
                   help="collective sizes in MiB, comma-separated (default 8,64,256 on GPUs, "
                        "1,4 on CPU)")
    p.add_argument("--hidden-size", type=int, help="the job's: adds its pipeline send/recv size")
    p.add_argument("--seq-length", type=int, help="the job's (with --hidden-size)")
    p.add_argument("--micro-batch-size", type=int, help="the job's (with --hidden-size)")
    p.add_argument("--ddp-bucket-size", type=int,
                   help="the job's gradient bucket in elements: adds the all-reduce, "
                        "reduce-scatter (fp32) and all-gather, broadcast (16-bit) of one bucket")
    p.add_argument("--nominal-gbps", type=float,
                   help="the link's nominal one-direction GB/s per GPU (default: by GPU kind, "
                        "NVLink within a node, one NIC per GPU across nodes; CPU: report only)")
    p.add_argument("--min-fraction", type=float, default=0.5,
                   help="a collective's largest size fails under this share of nominal")
    p.add_argument("--bandwidth-iters", type=int,
                   help="timed calls per collective and size (10 on GPUs, 3 on CPU)")
    p.add_argument("--train-iters", type=int, default=4,
                   help="iterations per training row (saved and resumed half way)")
    p.add_argument("--zero-stages", dest="stages", type=_list(int), default=[0, 1, 2, 3],
                   help="ZeRO stages of the training rows, comma-separated")
    p.add_argument("--precisions", type=_list(str),
                   help="bf16,fp16 on GPUs and fp32 on CPU by default")
    p.add_argument("--no-offload", dest="offload", action="store_false",
                   help="skip the row with the optimizer offloaded to the CPU")
    p.add_argument("--no-collectives", dest="collectives", action="store_false",
                   help="skip the collective rows")
    p.add_argument("--no-per-rank", dest="per_rank", action="store_false",
                   help="skip the per-rank compute and link timing rows")
    p.add_argument("--slow-factor", type=float, default=2.0,
                   help="a rank this many times slower than the median rank fails its per-rank "
                        "row")
    p.add_argument("--no-training", dest="training", action="store_false",
                   help="skip the training rows")
    p.add_argument("--workdir", default="check_cluster.tmp",
                   help="checkpoints of the training rows (on multi-node: a shared directory); "
                        "removed at the end")
    p.add_argument("--distributed-backend", dest="backend", choices=["nccl", "gloo"],
                   help="nccl where CUDA is available, else gloo")
    p.add_argument("--distributed-timeout-minutes", dest="timeout_minutes", type=float,
                   default=10.0, help="the process group's timeout")
    a = p.parse_args(argv)
    bad = [x for x in (a.precisions or []) if x not in ("fp32", "bf16", "fp16")]
    if bad or any(s not in (0, 1, 2, 3) for s in a.stages):
        p.error(f"--precisions takes fp32, bf16, fp16 and --zero-stages 0-3 (got "
                f"{a.precisions}, {a.stages})")
    return Options(**vars(a))


def main(argv: list[str] | None = None) -> int:
    from megazero.cluster_check.run import main as run

    return run(parse(argv))


if __name__ == "__main__":
    raise SystemExit(main())
