"""ZeRO-3 frees a unit's gathered parameters when it releases them after the forward: nothing
autograd saved for the backward may keep the gathered storage alive (a saved *view* of a weight
would, until the backward), or stage 3 holds the whole model gathered between forward and
backward. Checked on the GPT's real layers (column- and row-parallel linears, embeddings,
norms): no tensor autograd saved during the forward shares the storage of a unit's gathered
buffer once the unit is released."""

import torch

from megazero.config import ModelConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.testing import run_distributed
from megazero.zero import build_zero_optimizer
from megazero.zero.stage3 import Stage3Params


def _release_world(rank, world_size):
    topo = ParallelTopology.build()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                      vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(cfg, topo)
    engine = build_zero_optimizer([model], OptimizerConfig(lr=1e-3),
                                  ZeroConfig(stage=3, stage3_param_persistence_threshold=0,
                                             stage3_max_reuse_distance=0,
                                             stage3_prefetch_bucket_size=0),
                                  PrecisionConfig(), topo)
    gathered: dict[int, int] = {}  # unit index -> data pointer of its gathered buffer
    real = Stage3Params._gather

    def recording(self, u, async_op):
        real(self, u, async_op)
        if u.full is not None:
            gathered[u.index] = u.full.untyped_storage().data_ptr()

    saved: list[torch.Tensor] = []
    released_at: dict[int, int] = {}  # unit index -> number of tensors saved before its release
    real_release = Stage3Params._release

    def release(self, u):
        if u.full is not None and not u.persistent:
            released_at[u.index] = len(saved)
        real_release(self, u)

    Stage3Params._gather, Stage3Params._release = recording, release
    try:
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # the first step records the execution order
            gathered.clear()
            saved.clear()
            released_at.clear()
            engine.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: (saved.append(t), t)[1], lambda t: t):
                loss = model(tokens, torch.roll(tokens, -1, 1)).mean()
            units = {u.index: u for s in engine.stores for u in s.units}
            released = [i for i in gathered if units[i].full is None]
            # a tensor saved after the release may reuse the freed address: not a leak
            alive = sorted(i for i in released if any(
                t.numel() and t.untyped_storage().data_ptr() == gathered[i]
                for t in saved[:released_at[i]]))
            saved.clear()
            engine.backward(loss)
            engine.step()
    finally:
        Stage3Params._gather, Stage3Params._release = real, real_release
    return len(released), alive


def test_released_units_free_their_gathered_storage():
    for n_released, alive in run_distributed(_release_world, 2, timeout=300):
        assert n_released >= 8  # every linear, embedding and norm unit of the 2 layers
        assert alive == [], f"units {alive} stay gathered after their release"
