"""A loaded optimizer ``step`` counter sits where torch's update kernel reads it: the fused CUDA
AdamW refuses a host counter ("state_steps is on cpu"), so a resumed GPU run failed at its first
step. The policy is torch's own load_state_dict's: on the master's device for fused and
capturable kernels, on the host otherwise."""

import torch

import megazero.zero.optimizer as zero_optimizer
from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.testing.tiny_gpt import tiny_config
from megazero.zero import build_zero_optimizer
from megazero.zero.optimizers import place_step


def test_the_policy_follows_the_kernel():
    master = torch.empty(4, device="meta")
    for group, device in (({"fused": True}, "meta"), ({"capturable": True}, "meta"),
                          ({"foreach": True}, "cpu"), ({}, "cpu")):
        got = place_step(torch.tensor(7, dtype=torch.int64), master, group)
        assert (got.device.type, got.dtype) == (device, torch.float32), group


def test_every_loaded_counter_goes_through_the_policy(monkeypatch):
    topo = ParallelTopology.single()
    model = GPTModel(tiny_config("gpt2"), topo)
    for stage in (1, 3):
        engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-3), ZeroConfig(stage=stage),
                                      PrecisionConfig(bf16=True), topo)
        calls = []

        def spy(value, master, group, calls=calls):
            calls.append(id(master))
            return place_step(value, master, group)

        monkeypatch.setattr(zero_optimizer, "place_step", spy)
        engine.load_param_states(lambda p, kind, lo, dest: dest.zero_(),
                                 lambda p: torch.tensor(5.0))
        pieces = engine.masters.pieces
        assert sorted(calls) == sorted(id(pc.master) for pc in pieces)
        state = engine.masters.optimizer.state
        assert all(float(state[pc.master]["step"]) == 5.0 for pc in pieces)
