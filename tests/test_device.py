"""Which GPU each process takes under torchrun, srun and mpirun, and from megazero.initialize
after the script's own init_process_group: the rules of megazero.distributed.device with fake device
counts, so they run on a CPU."""

import os

import pytest
import torch

from megazero.config import ConfigError
from megazero.distributed.device import (
    choose_device_index,
    engine_device_index,
    export_launch,
    read_launch,
)


def _two_nodes_of_8(rank: int) -> dict[str, str]:
    """mpirun-like operator: RANK / WORLD_SIZE / LOCAL_RANK, no LOCAL_WORLD_SIZE."""
    return {"RANK": str(rank), "WORLD_SIZE": "16", "LOCAL_RANK": str(rank % 8),
            "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}


def test_no_local_world_size_16_ranks_on_two_nodes_of_8():
    for rank in range(16):
        env = _two_nodes_of_8(rank)
        launch = read_launch(env)
        assert launch is not None and launch.local_world_size is None  # unknown: not 16
        assert choose_device_index(env, 8, rank) == rank % 8
    # a node with more processes than GPUs is still refused, naming both counts
    env = {**_two_nodes_of_8(3), "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(ConfigError, match=r"8 processes on this node but only 4 visible GPU"):
        choose_device_index(env, 4, 3)
    with pytest.raises(ConfigError, match=r"local rank 6 but only 4 visible GPU"):
        choose_device_index(_two_nodes_of_8(6), 4, 6)


def test_slurm_one_visible_gpu_per_task():
    for rank in range(16):
        env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "16",
               "SLURM_LOCALID": str(rank % 8), "SLURM_TASKS_PER_NODE": "8(x2)",
               "CUDA_VISIBLE_DEVICES": str(rank % 8)}
        launch = export_launch(env)
        assert launch is not None and (launch.local_rank, launch.local_world_size) == (
            rank % 8, 8)
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (
            str(rank), "16", str(rank % 8))
        assert choose_device_index(env, 1, rank) == 0  # its one GPU, whatever the local rank
    # 8 tasks sharing one GPU that no launcher bound to them is refused
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "8"}
    with pytest.raises(ConfigError, match=r"8 processes on this node but only 1 visible GPU"):
        choose_device_index(env, 1, 1)


def test_mpirun_environment_only():
    env = {"OMPI_COMM_WORLD_RANK": "13", "OMPI_COMM_WORLD_SIZE": "16",
           "OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    launch = export_launch(env)
    assert launch is not None and launch.launcher == "mpirun (Open MPI)"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "13", "16", "5", "8")
    assert choose_device_index(env, 8, 13) == 5
    mv2 = {"MV2_COMM_WORLD_RANK": "9", "MV2_COMM_WORLD_SIZE": "16",
           "MV2_COMM_WORLD_LOCAL_RANK": "1"}
    assert choose_device_index(mv2, 8, 9) == 1
    # nothing says the local rank: rank % device count (DeepSpeed's fallback)
    assert choose_device_index({"RANK": "11", "WORLD_SIZE": "16"}, 8, 11) == 3
    assert read_launch({}) is None
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "0"}
    export_launch(torchrun)  # torchrun's variables win
    assert torchrun["RANK"] == "3"


def test_initialize_after_the_scripts_init_process_group(monkeypatch):
    """The script ran init_process_group itself (NCCL, LOCAL_RANK=3, 8 GPUs, device never
    set): megazero.initialize works on cuda:3 and makes it current, as DeepSpeed does."""
    import megazero.distributed.compat
    import megazero.engine as engine_api

    chosen = []
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 11)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(megazero.distributed.compat, "bound_device_index", lambda group=None: None)
    for k in ("CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine_api._device() == (torch.device("cuda", 3), 3)
    assert chosen == [3]
    # a device the script set (or bound the group to) is kept
    assert engine_device_index({"LOCAL_RANK": "3"}, 8, 11, current=5, bound=None) == 5
    assert engine_device_index({"LOCAL_RANK": "3"}, 8, 11, current=0, bound=6) == 6
    # no launcher variables at all (init_process_group from the script's own numbers)
    assert engine_device_index({}, 8, 11, current=0, bound=None) == 3
    # one visible GPU per process: device 0, whatever LOCAL_RANK says
    assert engine_device_index({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, 11,
                               current=0, bound=None) == 0


def test_init_process_group_is_bound_to_the_gpu():
    from megazero.distributed.compat import init_device_kwargs

    assert init_device_kwargs(torch.device("cuda", 2)) == {"device_id": torch.device("cuda", 2)}
    assert init_device_kwargs(torch.device("cpu")) == {}


def _launcher_env(monkeypatch, values):
    """Set a launcher's variables; every name the start-up may write is restored after."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in values.items():
        monkeypatch.setenv(k, v)


def test_start_up_under_mpirun_binds_the_group_to_the_local_gpu(monkeypatch):
    """initialize_distributed with Open MPI's variables only and 8 (fake) GPUs: rank 13 of 16
    takes cuda:5 before the group exists and binds the group to it (device_id)."""
    import megazero.distributed.startup as startup

    _launcher_env(monkeypatch, {"OMPI_COMM_WORLD_RANK": "13", "OMPI_COMM_WORLD_SIZE": "16",
                                "OMPI_COMM_WORLD_LOCAL_RANK": "5",
                                "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
                                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    current = [0]
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.__setitem__(0, i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(startup.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(startup.dist, "init_process_group",
                        lambda *a, **k: calls.append((a, k)))
    got = startup.initialize_distributed("nccl")
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (13, 16, 5, 8)
    assert got.device == torch.device("cuda", 5) and current == [5]
    (args, kwargs), = calls
    assert args == ("nccl",) and kwargs["rank"] == 13 and kwargs["world_size"] == 16
    assert kwargs["device_id"] == torch.device("cuda", 5)

    _launcher_env(monkeypatch, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="MASTER_ADDR / MASTER_PORT are not set"):
        startup.initialize_distributed("gloo")


def test_a_world_of_one_binds_its_store_at_once(monkeypatch):
    """Without a launcher the run is a world of one whose store binds a port the OS assigns: a
    port picked free and bound later could be taken by another job in between (EADDRINUSE)."""
    import megazero.distributed.startup as startup

    _launcher_env(monkeypatch, {})
    calls = []
    monkeypatch.setattr(startup.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(startup.dist, "init_process_group",
                        lambda *a, **k: calls.append((a, k)))
    got = startup.initialize_distributed("gloo")
    (args, kwargs), = calls
    store = kwargs["store"]
    assert isinstance(store, torch.distributed.TCPStore) and store.port > 0
    assert (got.rank, got.world_size) == (0, 1)
    assert os.environ["MASTER_PORT"] == str(store.port)
    assert (kwargs["rank"], kwargs["world_size"]) == (0, 1)


def test_torchrun_inside_srun_takes_torchruns_local_rank():
    """``srun torchrun ...``: SLURM's one task per node sees local id 0, torchrun's ranks are
    0..7 on the node; the GPU is torchrun's LOCAL_RANK, not SLURM_LOCALID."""
    env = {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_TASKS_PER_NODE": "1(x2)"}
    launch = read_launch(env)
    assert launch is not None and (launch.rank, launch.local_rank, launch.local_world_size) == (
        11, 3, 8)
    assert choose_device_index(env, 8, 11) == 3


def test_deepspeed_launchers_local_rank_argument():
    from megazero.distributed.device import adopt_local_rank_argument, local_rank_argument

    assert local_rank_argument(["--local_rank=2", "--lr", "1"]) == 2
    assert local_rank_argument(["--num-layers", "2", "--local-rank", "5"]) == 5
    assert local_rank_argument(["--num-layers", "2"]) is None
    env = {"RANK": "6", "WORLD_SIZE": "8"}  # the old torch.distributed.launch: no LOCAL_RANK
    adopt_local_rank_argument(["--local_rank=6"], env)
    assert env["LOCAL_RANK"] == "6" and choose_device_index(env, 8, 6) == 6
    env = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2"}  # the launcher's variable wins
    adopt_local_rank_argument(["--local_rank=6"], env)
    assert env["LOCAL_RANK"] == "2"
