"""A config read on a machine with GPUs: the GPU defaults (Megatron's overlap and buckets,
pinned offload buffers) follow the backend the run uses, not whether CUDA exists. A gloo run,
by flag or by the process group it is read in, keeps the CPU defaults."""

import json

import torch.distributed as dist

import megazero.config.merge as merge
from megazero.config import load_config

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def _cfg(tmp_path, *extra):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    return load_config([*TINY, "--deepspeed-config", str(path), *extra], world_size=1)


def test_gpu_defaults_follow_the_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(merge, "_cuda_available", lambda: True)
    nccl = _cfg(tmp_path)
    assert nccl.zero.offload_optimizer.pin_memory and nccl.zero.overlap_comm
    gloo = _cfg(tmp_path, "--distributed-backend", "gloo")
    assert not gloo.zero.offload_optimizer.pin_memory and not gloo.zero.overlap_comm
    assert gloo.zero.reduce_bucket_size != nccl.zero.reduce_bucket_size
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        inside = _cfg(tmp_path)
    finally:
        dist.destroy_process_group()
    assert inside.zero == gloo.zero
