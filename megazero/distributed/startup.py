"""Process start-up: torch.distributed from torchrun's environment, device, threads, the host
allocator (:mod:`megazero.distributed.host_allocator`, CPU runs) and seeds.

``torchrun`` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; ``srun`` and ``mpirun`` export their own names, which are
mapped to torchrun's (:mod:`megazero.distributed.device`, which also picks the GPU). A plain
``python pretrain_gpt.py`` (no launcher) becomes a world of one on a free local port, so the
training code never needs a non-distributed path.
"""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megazero.config import ConfigError
from megazero.distributed.compat import init_device_kwargs
from megazero.distributed.device import Launch, choose_device_index, export_launch
from megazero.distributed.host_allocator import keep_freed_host_memory


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # None: the launcher does not say
    backend: str
    device: torch.device


def choose_backend(requested: str | None) -> str:
    """nccl when CUDA is available, gloo otherwise; ``--distributed-backend`` overrides."""
    if requested:
        if requested == "nccl" and not torch.cuda.is_available():
            raise ConfigError("--distributed-backend nccl needs CUDA GPUs, but torch sees none; "
                               "use gloo on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def attempt_store(rank: int, world: int, timeout: timedelta) -> Any:
    """The launcher's store (``env://``) with a prefix unique to this launch attempt.

    Why: under ``torchrun --max-restarts`` the workers of every attempt meet in the same store
    (the launcher's, kept across rendezvous rounds), and the process group's own keys (each
    rank's address for gloo's connections, NCCL's id) have the same names in every attempt. A
    restarted rank may then read an address the failed attempt left and wait on a peer that is
    gone, or fail at once ("Connection refused"). Prefixing every key with the attempt
    (``TORCHELASTIC_RESTART_COUNT``) keeps attempts apart."""
    from torch.distributed import PrefixStore, rendezvous  # type: ignore[attr-defined]

    base, _, _ = next(rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"megazero/attempt-{attempt}", base)


def initialize_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> DistEnv:
    """Join (or create) the process group; pins this process to its GPU on CUDA machines
    (:func:`megazero.distributed.device.choose_device_index`) before the group exists, and binds
    the group to it (``device_id``), so NCCL creates its communicator on the right GPU."""
    env = os.environ
    launch = export_launch(env)
    store: Any = None
    if launch is None:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            # A world of one: its store listens on a port the OS assigns as it binds. A port
            # picked free first and bound later could be taken by another job in between
            # (EADDRINUSE).
            store = dist.TCPStore(env["MASTER_ADDR"], 0, 1, is_master=True,  # type: ignore[attr-defined]
                                  timeout=timedelta(minutes=timeout_minutes))
            env["MASTER_PORT"] = str(store.port)
        launch = Launch(0, 1, 0, 1, "none")
    elif (launch.world_size > 1 and not dist.is_initialized()
          and not ("MASTER_ADDR" in env and "MASTER_PORT" in env)):
        raise ConfigError(
            f"{launch.launcher} started rank {launch.rank} of {launch.world_size} but "
            "MASTER_ADDR / MASTER_PORT are not set: export them (the first node's address and "
            "a free port) so the ranks can meet, or launch with torchrun")
    rank, world = launch.rank, launch.world_size
    local_rank = launch.local_rank if launch.local_rank is not None else 0
    backend = choose_backend(backend)
    if env.get("MASTER_ADDR", "") in ("127.0.0.1", "localhost"):
        # Single-host runs (and the loopback multi-node test): keep gloo off other interfaces,
        # whose host name may not resolve in containers.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(choose_device_index(env, torch.cuda.device_count(), rank))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in env:
            # Processes on one host share its cores; oversubscription makes CPU runs crawl.
            share = launch.local_world_size or world
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, share)))
        # The model's tensors are host memory: keep what an iteration frees for the next.
        keep_freed_host_memory()
    if not dist.is_initialized():
        import_dynamo_before_the_group()
        if store is None and "TORCHELASTIC_RESTART_COUNT" in env:
            store = attempt_store(rank, world, timedelta(minutes=timeout_minutes))
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(minutes=timeout_minutes), store=store,
                                **init_device_kwargs(device))
    return DistEnv(rank, world, local_rank, launch.local_world_size, backend, device)


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


def import_dynamo_before_the_group() -> None:
    """Import ``torch._dynamo`` while no process group exists.

    Imported after ``init_process_group`` (``torch.nn.init`` on the meta device, ``torch.optim``
    and ``torch.compile`` import it), torch 2.13's dynamo keeps references to the default group
    that ``destroy_process_group`` does not drop. The group's worker threads then outlive the
    interpreter, and one that releases its last work item during finalization aborts the
    process ("terminate called without an active exception")."""
    import torch._dynamo  # noqa: F401


def destroy(orderly: bool = False) -> None:
    """Leave the process group; ``orderly`` (every rank passed a last barrier, nothing in
    flight): then also :func:`free_destroyed_groups`."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if orderly:
        free_destroyed_groups()


def free_destroyed_groups() -> None:
    """After an orderly exit (every rank passed a last barrier, the groups destroyed, the run
    dropped): free what still held the groups (cycles through the model and the engine) while
    the interpreter is whole. Each gloo group's destructor joins its worker threads, which drop
    their last work items (and the tensors' Python objects in them) with the interpreter still
    able to take them. Never after an error: a worker may still wait on a dead peer, and the
    join would wait with it. See :func:`import_dynamo_before_the_group`."""
    gc.collect()
