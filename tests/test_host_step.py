"""The offloaded step's host side, its logic on CPU: the update's thread count from the CPU
affinity and the ranks per node (torchrun's OMP_NUM_THREADS=1 is lifted for the step and
restored after), non-blocking device-to-host copies only into pinned memory from a GPU,
``pin_memory`` on by default where CUDA is available (an explicit JSON value wins), and the
fused Adam kernel on CUDA masters."""

import json
from types import SimpleNamespace

import torch

from megazero.config import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, load_config
from megazero.distributed.topology import ParallelTopology
from megazero.testing.reference import TinyLM, make_batches
from megazero.zero import build_zero_optimizer, host_step
from megazero.zero.optimizers import update_kernel


def test_cpus_per_rank():
    assert host_step.cpus_per_rank(affinity=64, node_cpus=64, local_world=8) == 8
    assert host_step.cpus_per_rank(affinity=64, node_cpus=64, local_world=1) == 64
    assert host_step.cpus_per_rank(affinity=4, node_cpus=4, local_world=8) == 1  # never 0
    # already bound by the launcher to fewer CPUs than the node has: that set is its share
    assert host_step.cpus_per_rank(affinity=6, node_cpus=96, local_world=8) == 6


def test_step_threads_from_affinity_and_local_world_size(monkeypatch):
    monkeypatch.setattr(host_step.os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setattr(host_step.os, "cpu_count", lambda: 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_step.step_threads() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host_step.step_threads() == 32


def test_offloaded_step_runs_on_the_ranks_cores_and_restores(monkeypatch):
    seen = []
    monkeypatch.setattr(host_step, "step_threads", lambda: 2)
    torch.set_num_threads(1)  # as under torchrun's OMP_NUM_THREADS=1
    model = TinyLM(vocab=64)
    zero = ZeroConfig(stage=1, offload_optimizer=OffloadConfig(device="cpu"))
    engine = build_zero_optimizer([model], OptimizerConfig(), zero, PrecisionConfig(),
                                  ParallelTopology.single())
    step = engine.masters.optimizer.step

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return step(*a, **k)

    engine.masters.optimizer.step = spy
    tokens, labels = make_batches(1, 2, 8, 64)[0]
    engine.backward(model(tokens, labels).float().mean())
    engine.step()
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == 1


def test_non_blocking_only_from_a_gpu_into_pinned_memory():
    gpu = SimpleNamespace(device=torch.device("cuda"))
    cpu = torch.zeros(2)
    pinned = SimpleNamespace(device=torch.device("cpu"), is_pinned=lambda: True)
    pageable = SimpleNamespace(device=torch.device("cpu"), is_pinned=lambda: False)
    assert host_step.non_blocking_copy([gpu], pinned)
    assert not host_step.non_blocking_copy([gpu], pageable)
    assert not host_step.non_blocking_copy([cpu], pinned)
    # on CPU the copies are plain and land in consecutive ranges
    dest = torch.zeros(5)
    views = host_step.copy_to_host([torch.ones(2), torch.full((3,), 2.0)], dest)
    assert torch.equal(dest, torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0]))
    assert [v.data_ptr() for v in views] == [dest.data_ptr(), dest[2:].data_ptr()]


def test_pin_memory_default_follows_the_backend(monkeypatch, tmp_path):
    """Pinned offload buffers where the run's tensors are on a GPU (NCCL, chosen where CUDA is
    available); a gloo run on the same machine keeps pageable ones."""
    import megazero.config.merge as merge

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 1 --train-iters 1 --zero-stage 1").split()

    def pin(block, cuda, *extra):
        monkeypatch.setattr(merge, "_cuda_available", lambda: cuda)
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"offload_optimizer": block}}))
        return load_config(base + ["--deepspeed_config", str(path), *extra], 1) \
            .zero.offload_optimizer.pin_memory

    assert pin({"device": "cpu"}, True) is True
    assert pin({"device": "cpu"}, False) is False
    assert pin({"device": "cpu"}, True, "--distributed-backend", "gloo") is False
    assert pin({"device": "cpu", "pin_memory": False}, True) is False  # explicit wins
    assert pin({"device": "cpu", "pin_memory": True}, False) is True


def test_fused_adam_on_cuda_masters():
    cuda = [{"params": [SimpleNamespace(device=torch.device("cuda"))]}]
    assert update_kernel(torch.optim.AdamW, cuda) == "fused"
    assert update_kernel(torch.optim.Adam, cuda) == "fused"
    assert update_kernel(torch.optim.SGD, cuda) == "foreach"
    mixed = [{"params": [SimpleNamespace(device=torch.device("cuda")), torch.zeros(1)]}]
    assert update_kernel(torch.optim.AdamW, mixed) == "foreach"
