"""Process start-up: torch.distributed from torchrun's environment, device, threads, the host
allocator (:mod:`megazero.host_allocator`, CPU runs) and seeds.

``torchrun`` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; ``srun`` on SLURM exports ``SLURM_PROCID`` and friends,
which are mapped to the same names. A plain ``python pretrain_gpt.py`` (no launcher) becomes a
world of one on a free local port, so the training code never needs a non-distributed path.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megazero.config import ConfigError
from megazero.host_allocator import keep_freed_host_memory


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _from_slurm(env: dict[str, str]) -> None:
    """``srun python pretrain_gpt.py`` without torchrun: translate SLURM's variables."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])


def choose_backend(requested: str | None) -> str:
    """nccl when CUDA is available, gloo otherwise; ``--distributed-backend`` overrides."""
    if requested:
        if requested == "nccl" and not torch.cuda.is_available():
            raise ConfigError("--distributed-backend nccl needs CUDA GPUs, but torch sees none; "
                               "use gloo on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_gpus_per_node(backend: str, local_world_size: int, gpu_count: int) -> None:
    """NCCL needs one GPU per process on a node; say so before NCCL does (its own error,
    ``ncclInvalidUsage``, names neither count)."""
    if backend == "nccl" and local_world_size > gpu_count:
        raise ConfigError(
            f"{local_world_size} processes on this node but only {gpu_count} visible GPU(s): "
            f"NCCL needs one GPU per process. Launch with --nproc_per_node {gpu_count} (or "
            "fewer), or pass --distributed-backend gloo to run the processes on the CPU")


def initialize_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> DistEnv:
    """Join (or create) the process group; pins this process to its GPU on CUDA machines."""
    env = os.environ
    _from_slurm(env)  # type: ignore[arg-type]
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    backend = choose_backend(backend)
    if env.get("MASTER_ADDR", "") in ("127.0.0.1", "localhost"):
        # Single-host runs (and the loopback multi-node test): keep gloo off other interfaces,
        # whose host name may not resolve in containers.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        check_gpus_per_node(backend, local_world, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in env:
            # Processes on one host share its cores; oversubscription makes CPU runs crawl.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        # The model's tensors are host memory: keep what an iteration frees for the next.
        keep_freed_host_memory()
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(minutes=timeout_minutes))
    return DistEnv(rank, world, local_rank, local_world, backend, device)


def enable_deterministic_mode() -> None:
    """Megatron's ``--deterministic-mode``: the same run twice (and a save/resume) gives bitwise
    equal losses on one GPU.

    cuBLAS needs a fixed workspace to pick the same reduction order every time (the variable is
    read when its handle is created, so this runs before the model's first matmul); torch's
    deterministic algorithms replace the atomics-based kernels (embedding and scatter
    backwards, SDPA's memory-efficient backward) or raise where no deterministic one exists;
    flash-attn's backward reads the same switch (:mod:`megazero.model.attention`). cuDNN's
    autotuner is turned off, since it may choose different kernels run to run.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def set_seed(seed: int, pp_rank: int = 0) -> None:
    """Megatron's rule: one seed per pipeline stage for python, numpy and torch. Weight
    initialisation does not use these (the model seeds its own generators per layer), so the
    same seed gives the same model at every layout."""
    s = seed + 100 * pp_rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
