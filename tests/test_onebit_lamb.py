"""1-bit Lamb (DeepSpeed's "type": "OneBitLamb") at ZeRO stage 0 on 4 gloo ranks driving the
real GPTModel, at dp 4 and at tp 2 x dp 2. Up to freeze_step it is Lamb (DeepSpeed's rule, no
bias correction) on the averaged gradients with whole-parameter trust ratios: losses and weights
equal the one-process Lamb to fp32 rounding at both layouts (a TP slice's own norm would not).
After it the gradients stay local, each step sends 1/32 of the fp32 exchange plus the scales,
the replicas stay equal, and training goes on (losses within 5% of the one-process run)."""

import torch
import torch.distributed as dist

from megazero.config import ModelConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.optim.lamb import Lamb
from megazero.optim.onebit_lamb import OneBitLamb
from megazero.tensor_parallel import full_model_state_dict
from megazero.testing import run_distributed
from megazero.zero import build_zero_optimizer

SEQ, VOCAB, HIDDEN, ROWS, FREEZE, STEPS = 16, 96, 32, 8, 4, 8
OPT = OptimizerConfig(optimizer="onebitlamb", lr=2e-2, weight_decay=0.1, clip_grad=0.0,
                      adam_eps=1e-6, freeze_step=FREEZE, bias_correction=False)
TOL, WTOL = 2e-5, 1e-4


def gpt_config():
    return ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                       vocab_size=VOCAB, attention_dropout=0.0, hidden_dropout=0.0,
                       add_bias_linear=False)


def batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def reference(opt_cls, steps, **kw):
    """One process, whole batch and whole tensors, no decay on ndim < 2."""
    model = GPTModel(gpt_config(), ParallelTopology.single())
    ps = list(model.parameters())
    opt = opt_cls([{"params": [p for p in ps if p.ndim >= 2]},
                   {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                  lr=OPT.lr, eps=OPT.adam_eps, weight_decay=OPT.weight_decay,
                  bias_correction=False, **kw)
    losses = []
    for tokens, labels in batches()[:steps]:
        model.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, full_model_state_dict(model, ParallelTopology.single())


def _run(topo):
    model = GPTModel(gpt_config(), topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), topo)
    assert type(engine.masters.optimizer) is OneBitLamb
    rows = ROWS // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    losses, comm, spread, warm = [], [], [], None
    for i, (tokens, labels) in enumerate(batches()):
        engine.zero_grad()
        loss = model(tokens[mine], labels[mine]).mean()
        engine.backward(loss)
        engine.finish_grad_sync()
        assert engine.step().updated
        t = torch.tensor([loss.item()])
        dist.all_reduce(t, group=topo.dp_group)
        losses.append(t.item() / topo.dp_size)
        comm.append(engine.comm_report()["logical_bytes"])
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        lo, hi = w.clone(), w.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=topo.dp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=topo.dp_group)
        spread.append((hi - lo).abs().max().item())
        if i + 1 == FREEZE:
            warm = full_model_state_dict(model, topo)
    return losses, comm, spread, warm


def _world(rank, world_size):
    lamb_losses, lamb_w = reference(Lamb, FREEZE)
    ref_losses, _ = reference(OneBitLamb, STEPS, freeze_step=FREEZE)  # one rank: no compression
    out = {}
    for tp in (1, 2):
        losses, comm, spread, warm = _run(ParallelTopology.build(tp=tp))
        werr = max(((warm[k] - lamb_w[k]).abs().max() / lamb_w[k].abs().max()).item()
                   for k in lamb_w)
        out[tp] = (losses, comm, spread, werr)
    return lamb_losses, ref_losses, out


def test_onebit_lamb_warmup_is_lamb_at_any_layout_then_one_bit():
    for lamb_losses, ref_losses, out in run_distributed(_world, 4, timeout=300):
        assert max(abs(a - b) for a, b in zip(lamb_losses, ref_losses)) < TOL
        for tp, (losses, comm, spread, werr) in out.items():
            case = f"tp{tp} dp{4 // tp}"
            assert max(abs(a - b) for a, b in zip(losses[:FREEZE + 1], ref_losses)) < TOL, case
            assert werr < WTOL, (case, werr)
            full = comm[0]["dp/all_reduce"]
            for step in comm[FREEZE:]:
                assert "dp/all_reduce" not in step, (case, step)
                signs = step["dp/compressed_allreduce"]
                assert 1 / 32 <= signs / full < 1.15 / 32, (case, signs / full)
            assert max(spread) < 1e-6, (case, spread)  # replicas stay equal
            assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, ref_losses)), case


def test_each_pasted_type_builds_and_steps():
    """DeepSpeed's blocks for every optimizer type megazero takes, as pasted: the config
    loader and the run's build give that optimizer with the block's parameters, and it steps
    (one process). OneBitLamb with sub-groups that cut its parameters is refused in one line."""
    import warnings
    from dataclasses import replace

    import pytest

    from megazero.config import ConfigError, load_config
    from megazero.training.builders import build_model_and_optimizer

    argv = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--vocab-size 96 --micro-batch-size 2 --train-iters 1").split()
    blocks = {
        "Adam": {"lr": 1e-3}, "AdamW": {"lr": 1e-3}, "SGD": {"lr": 0.1, "momentum": 0.9},
        "Lion": {"lr": 1e-4}, "Lamb": {"lr": 1e-3, "max_coeff": 0.3, "min_coeff": 0.01},
        "OneBitAdam": {"lr": 1e-3, "freeze_step": 1},
        "ZeroOneAdam": {"lr": 1e-3, "var_freeze_step": 1, "local_step_scaler": 1},
        "OneBitLamb": {"lr": 1e-3, "freeze_step": 1, "max_coeff": 0.3, "factor_max": 4.0}}
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    for kind, params in blocks.items():
        ds = {"train_batch_size": "auto", "zero_optimization": {"stage": 0},
              "optimizer": {"type": kind, "params": params}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_config(argv, 1, ds_config=ds)
        chunks, engine = build_model_and_optimizer(cfg, ParallelTopology.single(),
                                                   torch.device("cpu"))
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false: AdamW
        assert engine.masters.kind.name == {"Adam": "AdamW"}.get(kind, kind), kind
        group = engine.masters.optimizer.param_groups[0]
        assert group["lr"] == params["lr"], kind
        for _ in range(2):  # the 1-bit ones past their warm-up on the second step
            engine.zero_grad()
            engine.backward(chunks[0](tokens[:, :-1], tokens[:, 1:]).mean())
            engine.finish_grad_sync()
            assert engine.step().updated, kind
        if kind == "OneBitLamb":
            small = replace(cfg, zero=replace(cfg.zero, sub_group_size=1000))
            with pytest.raises(ConfigError, match="sub_group_size to at least") as e:
                build_model_and_optimizer(small, ParallelTopology.single(), torch.device("cpu"))
            assert "\n" not in str(e.value)


def _resume_world(rank, world_size, root):
    """Saved in the compressed phase (error buffers, frozen ratio, factor and momentum scales
    per rank), resumed at the same layout: the same numbers as not stopping."""
    from megazero.checkpoint import load_checkpoint, save_checkpoint

    topo = ParallelTopology.build()
    rows = ROWS // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)

    def train(model, engine, data):
        out = []
        for tokens, labels in data:
            engine.zero_grad()
            loss = model(tokens[mine], labels[mine]).mean()
            engine.backward(loss)
            engine.finish_grad_sync()
            engine.step()
            t = torch.tensor([loss.item()])
            dist.all_reduce(t)
            out.append(t.item() / topo.dp_size)
        return out

    data = batches()
    model = GPTModel(gpt_config(), topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), topo)
    train(model, engine, data[:FREEZE + 2])
    save_checkpoint(root, FREEZE + 2, topo, models=[model], optimizer=engine, scheduler=None,
                    consumed_samples=0, config={}, zero_stage=0)
    straight = train(model, engine, data[FREEZE + 2:])
    model = GPTModel(gpt_config(), topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), topo)
    load_checkpoint(root, topo, models=[model], optimizer=engine, scheduler=None, zero_stage=0)
    return straight, train(model, engine, data[FREEZE + 2:])


def test_onebit_lamb_resumes_with_its_per_rank_state(tmp_path):
    for straight, resumed in run_distributed(_resume_world, 4, str(tmp_path), timeout=300):
        assert max(abs(a - b) for a, b in zip(straight, resumed)) < 1e-6, (straight, resumed)
