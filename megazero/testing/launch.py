"""Running ``pretrain_gpt.py`` as users do, in a subprocess (``python`` for one process,
``torchrun`` for more), from a source checkout: the flags of a tiny run on mock data, the
environment a child gets, and reading its ``--log-json`` metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# the checkout holding this package (and pretrain_gpt.py)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "pretrain_gpt.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1", "--seed", "7",
        # The CPU suite runs on gloo whatever the machine has (a GPU box picks NCCL by default).
        "--distributed-backend", "gloo"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# fp32, 20 iterations: losses at tp2 x pp2 x dp2 (+SP, vpp 2, ZeRO-1) equal the one-process run
# to within fp32 rounding of differently ordered sums (observed <= 3e-8 relative).
LOSS_RTOL = 2e-6


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def run_training(args: list[str], nproc: int = 1, timeout: float = 240,
                 extra_env: dict[str, str] | None = None,
                 launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``pretrain_gpt.py`` with ``args``. The backend must be in ``args``: a GPU machine
    defaults to NCCL, so a CPU test that left it out would start NCCL ranks there."""
    if "--distributed-backend" not in args:
        raise ValueError("run_training: pass --distributed-backend explicitly (gloo for a CPU "
                         "test, nccl for a GPU one): without it a GPU machine starts NCCL ranks")
    if nproc == 1 and launcher is None:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        cmd = [TORCHRUN, *(launcher or ["--standalone"]), "--nproc_per_node", str(nproc),
               SCRIPT, *args]
    proc = subprocess.run(cmd, env={**env(), **(extra_env or {})}, cwd=REPO, timeout=timeout,
                          capture_output=True, text=True)
    return proc


def run_like_deepspeed(args: list[str], nproc: int, timeout: float = 240
                       ) -> subprocess.CompletedProcess:
    """Start ``pretrain_gpt.py`` on ``nproc`` local ranks as DeepSpeed's launcher
    (``deepspeed --num_gpus N pretrain_gpt.py ...``, its ``launcher/launch.py``) does: one
    process per rank with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``
    and its ``LOCAL_SIZE``/``CROSS_*`` in the environment, and ``--local_rank=N`` first on the
    command line. Returns the ranks' output together (rank 0's first) and the worst status."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        rank_env = {**env(), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc), "LOCAL_SIZE": str(nproc), "CROSS_RANK": "0",
                    "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-u", SCRIPT, f"--local_rank={rank}",
                                       *args], env=rank_env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=timeout) for p in procs]
    code = max((p.returncode for p in procs), key=abs)
    return subprocess.CompletedProcess(procs[0].args, code, "".join(o for o, _ in outs),
                                       "".join(e for _, e in outs))


def check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"
    return proc.stdout


def read_metrics(path) -> dict[int, dict]:
    """iteration -> the training metrics logged for it (validation records excluded)."""
    out = {}
    for line in open(path, encoding="utf-8"):
        rec = json.loads(line)
        if "learning-rate" in rec:  # training records; a skipped iteration has no lm loss
            out[rec["iteration"]] = rec
    return out
