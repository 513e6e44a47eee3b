"""A small stand-in for checkpointed training state: two linear layers marked as TP-sharded,
an optimizer with state, an LR scheduler and an RNG tracker, for checkpoint I/O tests that need
no model."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from megazero.checkpoint import save_checkpoint
from megazero.distributed.topology import ParallelTopology
from megazero.optim.lr_scheduler import LRScheduler
from megazero.tensor_parallel.layers import set_tensor_model_parallel_attributes


class StubRngTracker:
    """Stands in for the TP RNG tracker: named generator states with get/set."""

    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)

    def get_states(self):
        return {"model-parallel-rng": self.gen.get_state()}

    def set_states(self, states):
        self.gen.set_state(states["model-parallel-rng"])


class MomentumSGD:
    """A minimal optimizer with state (torch.optim would import torch._dynamo in every rank,
    seconds on a small machine)."""

    def __init__(self, params, lr):
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state = {}

    def zero_grad(self):
        for p in self.param_groups[0]["params"]:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            buf = self.state.setdefault(p, {"momentum_buffer": torch.zeros_like(p)})
            buf["momentum_buffer"].mul_(0.9).add_(p.grad)
            p.sub_(self.param_groups[0]["lr"] * buf["momentum_buffer"])

    def state_dict(self):
        params = self.param_groups[0]["params"]
        return {"momentum": [self.state[p]["momentum_buffer"].clone() for p in params],
                "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, sd):
        for p, m in zip(self.param_groups[0]["params"], sd["momentum"]):
            self.state[p] = {"momentum_buffer": m.clone()}
        # Like torch.optim: loading builds a new group list (the scheduler must follow it).
        self.param_groups = [{"params": self.param_groups[0]["params"], "lr": sd["lr"]}]


def build_state(topo, seed=0):
    """``(models, optimizer, scheduler, rng_tracker)`` seeded per rank from ``seed``."""
    torch.manual_seed(seed + 10 * topo.tp_rank + 100 * topo.pp_rank)
    np.random.seed(seed + topo.rank)
    random.seed(seed + topo.rank)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    for p in (p for m in models for p in m.parameters()):  # each TP rank holds its own rows
        set_tensor_model_parallel_attributes(p, 0)
    opt = MomentumSGD([p for m in models for p in m.parameters()], lr=0.1)
    sched = LRScheduler(opt, lambda step: 0.1 / (1 + step))
    return models, opt, sched, StubRngTracker(seed + topo.rank)


def train_steps(models, opt, sched, n):
    for _ in range(n):
        opt.zero_grad()
        x = torch.randn(5, 4)
        models[1](models[0](x)).square().mean().backward()
        opt.step()
        sched.step()


def save_single(root):
    """Train two steps on one process and save iteration 3 under ``root``; returns its
    directory."""
    topo = ParallelTopology.single()
    models, opt, sched, tracker = build_state(topo)
    train_steps(models, opt, sched, 2)
    save_checkpoint(root, 3, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=24, config={"model": {"hidden_size": 4}},
                    rng_tracker=tracker)
    return os.path.join(root, "iter_0000003")
