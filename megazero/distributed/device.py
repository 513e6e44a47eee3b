"""Which process this is on its node, and which GPU it drives, from any launcher's environment.

Pure functions of an environment mapping and a device count, so every launcher's rules are
tested on a CPU with a fake count (``tests/test_device.py``); :mod:`megazero.distributed.startup`
and :func:`megazero.initialize` apply them.

Launchers say different things:

- ``torchrun`` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``;
- ``srun`` exports ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the tasks per node
  (``SLURM_NTASKS_PER_NODE`` only when asked for, ``SLURM_TASKS_PER_NODE`` as ``8(x2),4``);
- DeepSpeed's ``deepspeed`` launcher exports torchrun's names and passes ``--local_rank=N``;
- ``mpirun`` (Open MPI) exports ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``,
  MVAPICH the same with ``MV2_COMM_WORLD_``; other operators set ``RANK``/``WORLD_SIZE`` only.

When the number of processes on this node cannot be known it is ``None`` and nothing compares
the world size with one node's GPUs (the old rule refused a 16-rank job on two 8-GPU nodes).
With one GPU visible to the process (``srun --gpus-per-task=1``, or ``CUDA_VISIBLE_DEVICES``
set per process by the launcher) that GPU is device 0 whatever the local rank.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from megazero.config import ConfigError

# First match wins: torchrun's names, then SLURM's, then the MPI launchers'.
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "MV2_COMM_WORLD_LOCAL_RANK")
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
                   "SLURM_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                   "MV2_COMM_WORLD_LOCAL_SIZE")
# (rank, world size, launcher) when torchrun's RANK is absent
RANK_VARS = (("SLURM_PROCID", "SLURM_NTASKS", "srun"),
             ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
             ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "mpirun (MVAPICH)"),
             ("PMI_RANK", "PMI_SIZE", "a PMI launcher"))


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process. ``local_rank`` / ``local_world_size`` are None
    when its environment does not say."""

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    launcher: str


def first_count(value: str) -> int:
    """``SLURM_TASKS_PER_NODE``'s first node count: ``"8(x2),4"`` -> 8, ``"8"`` -> 8."""
    return int(value.split(",")[0].split("(")[0])


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return first_count(env[name])
    return None


def read_launch(env: Mapping[str, str]) -> Launch | None:
    """This process's place in the job, or None without a launcher (a world of one)."""
    if "RANK" in env:
        rank, world, launcher = int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), "torchrun"
    else:
        found = next(((r, w, n) for r, w, n in RANK_VARS if r in env), None)
        if found is None:
            return None
        rank, world, launcher = int(env[found[0]]), int(env.get(found[1], "1")), found[2]
    local_rank = _first(env, LOCAL_RANK_VARS)
    local_size = _first(env, LOCAL_SIZE_VARS)
    if world == 1:
        local_rank, local_size = 0, 1
    return Launch(rank, world, local_rank, local_size, launcher)


def export_launch(env: MutableMapping[str, str]) -> Launch | None:
    """Write what another launcher said under torchrun's names (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` when known), which ``init_process_group``'s
    ``env://`` and scripts written for torchrun read. torchrun's own variables are kept."""
    launch = read_launch(env)
    if launch is None or "RANK" in env:
        return launch
    env["RANK"], env["WORLD_SIZE"] = str(launch.rank), str(launch.world_size)
    if launch.local_rank is not None:
        env.setdefault("LOCAL_RANK", str(launch.local_rank))
    if launch.local_world_size is not None:
        env.setdefault("LOCAL_WORLD_SIZE", str(launch.local_world_size))
    return launch


def local_rank_argument(argv: Sequence[str]) -> int | None:
    """The ``--local_rank=N`` (or ``--local-rank N``) that DeepSpeed's launcher and the old
    ``torch.distributed.launch`` pass on the command line, or None. Both also export
    ``LOCAL_RANK``, which wins where both are given; the argument fills it where it is missing
    (:func:`adopt_local_rank_argument`)."""
    for i, token in enumerate(argv):
        name, has_value, value = token.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not has_value:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            if value.strip().isdigit():
                return int(value)
    return None


def adopt_local_rank_argument(argv: Sequence[str], env: MutableMapping[str, str]) -> None:
    """``LOCAL_RANK`` from the command line's ``--local_rank`` when the launcher exported none."""
    local = local_rank_argument(argv)
    if local is not None:
        env.setdefault("LOCAL_RANK", str(local))


def one_gpu_per_process(env: Mapping[str, str], device_count: int) -> bool:
    """The launcher bound this process to one GPU: it sees exactly one, named in
    ``CUDA_VISIBLE_DEVICES`` (SLURM sets it per task under ``--gpus-per-task=1``)."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return device_count == 1 and len(visible) == 1


def choose_device_index(env: Mapping[str, str], device_count: int, rank: int) -> int:
    """The CUDA device index this process drives (DeepSpeed's rule: the launcher's local rank,
    else ``rank % device_count``), after the checks NCCL would otherwise fail on with an error
    naming neither count."""
    if device_count < 1:
        raise ConfigError("NCCL needs a GPU per process, but this process sees none "
                          f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                          "check the job's GPU request, or pass --distributed-backend gloo to "
                          "run on the CPU")
    if one_gpu_per_process(env, device_count):
        return 0
    launch = read_launch(env)  # None: the script made its group from its own rank numbers
    local_rank = launch.local_rank if launch is not None else None
    local_size = launch.local_world_size if launch is not None else None
    if local_size is not None and local_size > device_count:
        raise ConfigError(
            f"{local_size} processes on this node but only {device_count} visible GPU(s): "
            f"NCCL needs one GPU per process. Launch with --nproc_per_node {device_count} (or "
            "fewer; under srun --ntasks-per-node, or --gpus-per-task=1 to give each task its "
            "own GPU), or pass --distributed-backend gloo to run the processes on the CPU")
    index = local_rank if local_rank is not None else rank % device_count
    if index >= device_count:
        raise ConfigError(
            f"local rank {index} but only {device_count} visible GPU(s) on this node: NCCL "
            "needs one GPU per process. Start at most as many processes per node as it has "
            "GPUs (or bind one GPU per process, e.g. srun --gpus-per-task=1)")
    return index


def engine_device_index(env: Mapping[str, str], device_count: int, rank: int,
                        current: int, bound: int | None) -> int:
    """The device :func:`megazero.initialize` uses when the script made the process group.

    A device the process group is bound to (``init_process_group(device_id=...)``) or one the
    script chose with ``torch.cuda.set_device`` (any device but the default 0) is kept: the
    script's tensors and NCCL communicator may already live there. Otherwise DeepSpeed's
    choice (:func:`choose_device_index`). DeepSpeed itself always moves to ``LOCAL_RANK``; the
    two agree except where a script deliberately set another device, which megazero keeps.
    """
    if bound is not None:
        return bound
    if current != 0:
        return current
    return choose_device_index(env, device_count, rank)
