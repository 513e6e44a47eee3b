"""ZeRO stage 3 with MoE experts whose expert-data-parallel group is not the data-parallel one:
4 gloo ranks, expert parallel 2 and tensor parallel 1, so dense units are partitioned over
dp = 4 and expert units over edp = 2. Each rank trains on its own batch; losses, grad norms and
the final weights equal the one-process model trained on the 4 batches. One spawned world,
under the NCCL-rules mode (each group's collectives in one order on all its ranks, no host
tensor reaching a collective), runs every case: parameters offloaded to the host with
overlapped reductions and prefetch, offloaded to NVMe, and kept whole (persistent units); the
planner's model-state bytes and stage-3 layout equal the engine's, and
``GatheredParameters(modifier_rank=0)`` writes each expert's values back from rank 0 of its
expert-data-parallel group. A second world runs the training loop at 8 ranks with PP 2 and EP 2
(edp 2, dp 4: no_sync, 1F1B, recompute) under the same mode, with the one-process losses.
The aux loss is off: its injected gradient is not scaled by the reference's mean over ranks
(the end-to-end tests cover it against the one-process ``pretrain_gpt.py`` run)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from megazero.config import ModelConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.config.moe_schema import MoEConfig
from megazero.config.optim_schema import OffloadConfig
from megazero.errors import MegazeroError
from megazero.testing import run_distributed

WORLD, EP, STEPS = 4, 2, 3
OPT = OptimizerConfig(lr=2e-2, clip_grad=1.0)
CASES = ["cpu-allgather", "nvme-alltoall", "persistent-alltoall"]


def _zero(case: str, tmp: str, rank: int) -> ZeroConfig:
    kw: dict = dict(stage=3, reduce_bucket_size=600, overlap_comm=True,
                    stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=500,
                    stage3_max_live_parameters=2000, stage3_param_persistence_threshold=0)
    if case.startswith("cpu"):
        kw["offload_param"] = OffloadConfig(device="cpu")
    elif case.startswith("nvme"):
        kw["offload_param"] = OffloadConfig(device="nvme", nvme_path=tmp,
                                            buffer_count=6, buffer_size=1024, max_in_cpu=0)
    else:
        kw["stage3_param_persistence_threshold"] = 10**6
    return ZeroConfig(**kw)


def _cfg(dispatcher: str) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=True,
                       add_bias_linear=False, moe=MoEConfig(
                           num_experts=4, moe_ffn_hidden_size=12, moe_router_topk=2,
                           moe_token_dispatcher_type=dispatcher))


class _Net(nn.Module):
    """A dense linear, then an MoE layer (router dense, experts ``expert = True``)."""

    def __init__(self, cfg: ModelConfig, parallel=None) -> None:
        super().__init__()
        from megazero.moe.moe_layer import MoELayer

        self.inp = nn.Linear(8, 8, bias=False)
        self.moe = MoELayer(cfg, parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.inp(x))


def _build(cfg: ModelConfig, parallel=None) -> _Net:
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.init import initialize_parameters

    torch.manual_seed(3)
    net = _Net(cfg, parallel)
    initialize_parameters(net.moe, cfg, ParallelTopology.single(), 9)
    return net


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)


def _world(rank: int, world: int, tmp: str) -> list:
    from megazero.distributed.topology import ParallelTopology
    from megazero.tensor_parallel.context import ParallelContext
    from megazero.zero import build_zero_optimizer
    from megazero.zero.stage3 import Stage3Params

    topo = ParallelTopology.build(ep=EP, expert_groups=True)
    assert (topo.dp_size, topo.edp_size) == (4, 2)
    out = []
    for case in CASES:
        cfg = _cfg(case.split("-")[1])
        net = _build(cfg, ParallelContext(ep_group=topo.ep_group))
        engine = build_zero_optimizer([net], OPT, _zero(case, tmp, rank), PrecisionConfig(),
                                      topo)
        (store,) = engine.stores
        assert isinstance(store, Stage3Params)
        groups = {bool(getattr(u.params[0], "expert", False)): u.comm.size for u in store.units}
        assert groups == {False: 4, True: 2}, groups  # experts over edp, the rest over dp
        losses, norms = [], []
        for step in range(STEPS):
            x, g = _data(step, rank)
            loss = (net(x) * g).sum()
            engine.backward(loss)
            res = engine.step()
            losses.append(loss.item())
            norms.append(res.grad_norm)
        if not case.startswith("nvme"):  # the planner's bytes, experts' shards over edp
            from megazero.planner.model_states import model_state_report

            rep = model_state_report([_build(cfg, ParallelContext(ep_group=topo.ep_group))],
                                     _zero(case, tmp, rank), PrecisionConfig(), dp=4,
                                     dp_rank=topo.dp_rank, optimizer=OPT, edp=2,
                                     edp_rank=topo.edp_rank)
            mem = engine.memory_report()
            assert (mem["bytes"], mem["padding_elements"]) == (
                rep.bytes, rep.padding_elements), case
            _check_planned_buckets(store, _build(cfg, ParallelContext(ep_group=topo.ep_group)),
                                   _zero(case, tmp, rank), topo)
        with engine.gathered_parameters():
            weights = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
        out.append((losses, norms, weights))
        if case.startswith("cpu"):
            _modify_through_gathered_parameters(net, engine, topo)
    return out


def _check_planned_buckets(store, net, zero: ZeroConfig, topo) -> None:
    """The estimator's stage-3 layout (units gathered, largest unit, gradient buckets) is the
    engine's: expert units padded to edp, never in a bucket with dense ones."""
    from types import SimpleNamespace

    from megazero.planner.estimate import zero3_layout

    cfg = SimpleNamespace(zero=zero, parallel=SimpleNamespace(sequence_parallel=False))
    plan = zero3_layout(cfg, net, topo, dp=4, edp=2)
    assert plan.buckets == [b.numel() for b in store.buckets]
    assert all(len({u.comm.size for u in b.units}) == 1 for b in store.buckets)
    assert plan.largest_unit == max(u.padded for u in store.units)
    assert plan.gathered == sum(not u.persistent for u in store.units)


def _modify_through_gathered_parameters(net, engine, topo) -> None:
    """``GatheredParameters(modifier_rank=0)`` takes each parameter's values from rank 0 of its
    replica group: dp for dense weights, edp for experts (each edp group has other experts)."""
    from megazero.zero.init_context import GatheredParameters

    for store in engine.stores:  # as megazero.initialize marks them
        for p in store.params():
            p.mz_engine, p.mz_stage3_store = engine, store
    params = {n: p for n, p in net.named_parameters()
              if n == "inp.weight" or n.endswith("linear_fc1.weight")}
    with GatheredParameters(list(params.values()), modifier_rank=0):
        for p in params.values():
            p.data.fill_(100.0 + topo.rank)
    want = {n: 100.0 + (topo.ranks("edp")[0] if getattr(p, "expert", False) else 0)
            for n, p in params.items()}
    with engine.gathered_parameters():
        for n, p in params.items():
            assert bool((p == want[n]).all()), (n, want[n], p.flatten()[:4])
    for pc in engine.masters.pieces:  # the fp32 masters took the same values
        name = next((n for n, p in params.items() if p is pc.param), None)
        if name is not None:
            assert bool((pc.master == want[name]).all()), name


def _reference(dispatcher: str) -> tuple[list[list[float]], list[float], dict]:
    """The one-process model on all ranks' batches: the mean of the ranks' losses."""
    from megazero.distributed.topology import ParallelTopology
    from megazero.zero import build_zero_optimizer

    net = _build(_cfg(dispatcher))
    engine = build_zero_optimizer([net], OPT, ZeroConfig(stage=0), PrecisionConfig(),
                                  ParallelTopology.single())
    losses, norms = [], []
    for step in range(STEPS):
        per_rank = []
        for rank in range(WORLD):
            x, g = _data(step, rank)
            per_rank.append((net(x) * g).sum())
        engine.backward(torch.stack(per_rank).mean())
        norms.append(engine.step().grad_norm)
        losses.append([v.item() for v in per_rank])
    return losses, norms, {n: p.detach().clone() for n, p in net.named_parameters()}


def test_zero3_partitions_experts_over_edp_and_trains_the_one_process_model(tmp_path):
    results = run_distributed(_world, WORLD, str(tmp_path), timeout=300, nccl_rules=True)
    for i, case in enumerate(CASES):
        ref_losses, ref_norms, ref_weights = _reference(case.split("-")[1])
        for rank in range(WORLD):
            losses, norms, weights = results[rank][i]
            what = f"{case} rank {rank}"
            assert losses == pytest.approx([s[rank] for s in ref_losses], rel=1e-5), what
            assert norms == pytest.approx(ref_norms, rel=1e-5), what
            for n, w in weights.items():
                torch.testing.assert_close(torch.from_numpy(w), ref_weights[n], rtol=1e-5,
                                           atol=1e-6, msg=f"{what} {n}")


def test_a_unit_mixing_expert_and_dense_parameters_is_refused_by_name():
    from megazero.zero.units import unit_is_expert

    dense, expert = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    expert.expert = True
    assert unit_is_expert([expert]) and not unit_is_expert([dense])
    with pytest.raises(MegazeroError, match=r"mixes MoE expert and dense parameters"):
        unit_is_expert([dense, expert])


def _pipeline_world(rank: int, world: int, zero3_json: str) -> dict[int, float]:
    """The training loop (1F1B, two micro-batches per step, the first under no_sync) at 8
    ranks, PP 2, EP 2 with ZeRO 3 (edp 2, dp 4): every unit partitioned and released after its
    forward, recomputed layers, alltoall dispatch. ``world`` 1: the one-process run."""
    from megazero.testing.moe_runs import MOE
    from megazero.testing.training_runs import TINY, train_in_rank

    args = [*TINY, *MOE, "--moe-token-dispatcher-type", "alltoall", "--global-batch-size", "16",
            "--train-iters", "2"]
    if world > 1:
        args += ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--zero-stage", "3", "--deepspeed_config", zero3_json,
                 "--recompute-granularity", "full", "--recompute-method", "uniform"]
    return train_in_rank(rank, world, args)


def test_zero3_experts_under_pipeline_parallelism_keep_the_nccl_order(tmp_path):
    cfg = tmp_path / "zero3.json"
    cfg.write_text(json.dumps({"zero_optimization": {
        "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
        "overlap_comm": True, "stage3_prefetch_bucket_size": 2000}}))
    (ref,) = run_distributed(_pipeline_world, 1, str(cfg), timeout=120)
    losses = run_distributed(_pipeline_world, 8, str(cfg), timeout=300, nccl_rules=True)
    assert len(ref) == 2
    for got in losses:  # every rank's logged loss (the last stage's, shared)
        assert got == pytest.approx(ref, rel=2e-6), (ref, losses)
