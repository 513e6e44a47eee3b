"""ZeRO runs the optimizer it is given: Adam with L2 decay, AdamW, SGD with momentum and Lion,
at stages 0-3 and with the optimizer offloaded, each equal to a plain one-process loop on the
whole batch (torch.optim; for Lion the paper's update rule written out below), comparing
losses, weights and every per-element state tensor. The portable checkpoint saves and resumes
each optimizer's state and refuses another optimizer's; the DeepSpeed JSON and Megatron flags
map to the right optimizer."""

import warnings

import pytest
import torch
import torch.distributed as dist

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.checkpoint.tensors import param_infos
from megazero.config import (
    ConfigError,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
    load_config,
)
from megazero.distributed.topology import ParallelTopology
from megazero.errors import CheckpointError
from megazero.testing import run_distributed
from megazero.testing.legacy_checkpoint import optimizer_state_per_param
from megazero.testing.reference import TinyLM, engine_train_step, make_batches
from megazero.zero import build_zero_optimizer

STEPS, BATCH, SEQ, VOCAB = 4, 8, 8, 64
CLIP, WD = 1.0, 0.1
TOL = 5e-6  # fp32 rounding: sums in another order (dp reduction, sharded norm); seen < 1e-6

class PaperLion:
    """Lion as the paper writes it (Chen et al. 2023, Algorithm 2), one tensor at a time."""

    def __init__(self, groups, lr, betas, weight_decay):
        self.param_groups = [{"lr": lr, "betas": betas, "weight_decay": weight_decay, **g}
                             for g in groups]
        self.state = {}

    def zero_grad(self):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                m = self.state.setdefault(p, {"exp_avg": torch.zeros_like(p)})["exp_avg"]
                c = beta1 * m + (1 - beta1) * p.grad
                p.copy_(p - g["lr"] * (torch.sign(c) + g["weight_decay"] * p))
                m.copy_(beta2 * m + (1 - beta2) * p.grad)


#: name -> (engine config, the plain torch optimizer over the reference's two groups)
OPTIMIZERS = {
    "Adam (L2)": (OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=WD, clip_grad=CLIP),
                  lambda g: torch.optim.Adam(g, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                             weight_decay=WD)),
    "AdamW": (OptimizerConfig(optimizer="adamw", lr=1e-2, weight_decay=WD, clip_grad=CLIP),
              lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                          weight_decay=WD)),
    "SGD momentum": (OptimizerConfig(optimizer="sgd", lr=0.2, sgd_momentum=0.9,
                                     sgd_dampening=0.1, weight_decay=WD, clip_grad=CLIP),
                     lambda g: torch.optim.SGD(g, lr=0.2, momentum=0.9, dampening=0.1,
                                               weight_decay=WD)),
    "Lion": (OptimizerConfig(optimizer="lion", lr=1e-3, adam_beta2=0.99, weight_decay=0.5,
                             clip_grad=CLIP),
             lambda g: PaperLion(g, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5)),
}
STATE = {"Adam (L2)": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
         "SGD momentum": ("momentum_buffer",), "Lion": ("exp_avg",)}
CPU = OffloadConfig(device="cpu")
STAGES = [("stage 0", dict(stage=0)), ("stage 1", dict(stage=1)), ("stage 2", dict(stage=2)),
          ("stage 3", dict(stage=3, stage3_param_persistence_threshold=0)),
          ("stage 2 + cpu offload, sub-groups of 100",
           dict(stage=2, offload_optimizer=CPU, sub_group_size=100))]


def _tiny(seed: int = 0) -> TinyLM:
    m = TinyLM(vocab=VOCAB, seed=seed)
    m.embedding.weight.zero_external = True  # tied: used by the output projection too
    return m


def reference(name, batches):
    """One process, whole batch: the torch optimizer, no decay on biases and norm weights."""
    model = _tiny()
    params = list(model.parameters())
    opt = OPTIMIZERS[name][1]([{"params": [p for p in params if p.ndim >= 2]},
                               {"params": [p for p in params if p.ndim < 2],
                                "weight_decay": 0.0}])
    losses = []
    for tokens, labels in batches:
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: opt.state[p][k].clone() for k in STATE[name]}
             for n, p in model.named_parameters()}
    return losses, weights, state


def _train(model, engine, batches, topo):
    rows = BATCH // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    losses = []
    for tokens, labels in batches:
        loss, res = engine_train_step(model, engine, tokens[mine], labels[mine])
        assert res.updated
        t = torch.tensor([loss])
        dist.all_reduce(t)
        losses.append(t.item() / topo.dp_size)
    return losses


def _full_state(model, engine):
    """Weights and per-element optimizer state by parameter name, gathered over dp (format
    version 2's gather, kept as a test reference)."""
    names = {id(p): n for n, p in model.named_parameters()}
    full = engine.full_parameters()
    infos = param_infos([model], 0, 1)
    state = optimizer_state_per_param(engine, infos, {k: v.shape for k, v in full.items()})
    return ({names[k]: v for k, v in full.items()}, {names[k]: v for k, v in state.items()})


def _diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in b)


def _equivalence_world(rank, world_size):
    topo = ParallelTopology.build()
    batches = make_batches(STEPS, BATCH, SEQ, VOCAB)
    out = []
    for name, (cfg, _) in OPTIMIZERS.items():
        ref_losses, ref_w, ref_state = reference(name, batches)
        for stage, zkw in STAGES:
            model = _tiny()
            engine = build_zero_optimizer([model], cfg, ZeroConfig(reduce_bucket_size=300, **zkw),
                                          PrecisionConfig(), topo)
            losses = _train(model, engine, batches, topo)
            weights, state = _full_state(model, engine)
            ds = {k: max((state[n][k] - ref_state[n][k]).abs().max().item() for n in ref_state)
                  for k in STATE[name]}
            out.append((name, stage, type(engine.masters.optimizer).__name__,
                        max(abs(a - b) for a, b in zip(losses, ref_losses)),
                        _diff(weights, ref_w), ds, sorted(state[next(iter(state))])))
    return out


# The reference gathers the optimizer state with the old checkpoint writer's all-reduce of host
# buffers (test support only); the suite-wide NCCL-rules mode would refuse the reference itself.
@pytest.mark.nccl_rules_off
def test_each_optimizer_matches_one_process_loop_at_every_stage():
    classes = {"Adam (L2)": "Adam", "AdamW": "AdamW", "SGD momentum": "SGD", "Lion": "Lion"}
    for results in run_distributed(_equivalence_world, 2, timeout=300):
        assert len(results) == len(OPTIMIZERS) * len(STAGES)
        for name, stage, cls, dl, dw, ds, keys in results:
            case = f"{name}, {stage}"
            assert cls == classes[name], case
            assert dl < TOL, f"{case}: losses differ by {dl:.3g}"
            assert dw < TOL, f"{case}: weights differ by {dw:.3g}"
            for k, d in ds.items():
                assert d < TOL, f"{case}: {k} differs by {d:.3g}"
            want = {"master", *STATE[name]} | ({"step"} if "Adam" in name else set())
            assert set(keys) == want, case


def _resume_world(rank, world_size, root):
    """Save after 2 steps at stage 1, load into other weights at stage 3, 2 more steps: the
    same as 4 uninterrupted steps of the one-process loop. An engine with another optimizer
    refuses the checkpoint; NVMe swap refuses SGD."""
    topo = ParallelTopology.build()
    batches = make_batches(STEPS, BATCH, SEQ, VOCAB)
    out = {}
    for name in ("SGD momentum", "Adam (L2)"):
        cfg = OPTIMIZERS[name][0]
        ref_losses, ref_w, ref_state = reference(name, batches)
        where = f"{root}/{name.split()[0]}"
        model = _tiny()
        engine = build_zero_optimizer([model], cfg, ZeroConfig(stage=1), PrecisionConfig(), topo)
        _train(model, engine, batches[:2], topo)
        out[f"{name} state_dict"] = engine.state_dict()
        save_checkpoint(where, 2, topo, models=[model], optimizer=engine, scheduler=None,
                        consumed_samples=16, config={}, zero_stage=1)
        model = _tiny(seed=99)
        engine = build_zero_optimizer([model], cfg, ZeroConfig(stage=3), PrecisionConfig(), topo)
        load_checkpoint(where, topo, models=[model], optimizer=engine, scheduler=None,
                        zero_stage=3)
        losses = _train(model, engine, batches[2:], topo)
        weights, state = _full_state(model, engine)
        out[name] = (max(abs(a - b) for a, b in zip(losses, ref_losses[2:])),
                     _diff(weights, ref_w),
                     max((state[n][k] - ref_state[n][k]).abs().max().item()
                         for n in ref_state for k in STATE[name]))
    other = _tiny()
    engine = build_zero_optimizer([other], OPTIMIZERS["AdamW"][0], ZeroConfig(stage=1),
                                  PrecisionConfig(), topo)
    try:
        load_checkpoint(f"{root}/SGD", topo, models=[other], optimizer=engine, scheduler=None,
                        zero_stage=1)
        out["mismatch"] = None
    except CheckpointError as e:
        out["mismatch"] = str(e)
    try:  # the engine's own (same-layout) state dict
        engine.load_state_dict(out.pop("SGD momentum state_dict"))
        out["mismatch_sd"] = None
    except ConfigError as e:
        out["mismatch_sd"] = str(e)
    out.pop("Adam (L2) state_dict")
    nvme = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="nvme",
                                                               nvme_path=f"{root}/swap{rank}"))
    try:
        build_zero_optimizer([_tiny()], OPTIMIZERS["SGD momentum"][0], nvme, PrecisionConfig(),
                             topo)
        out["nvme"] = None
    except ConfigError as e:
        out["nvme"] = str(e)
    return out


def test_checkpoint_resume_per_optimizer_and_refusals(tmp_path):
    for r in run_distributed(_resume_world, 2, str(tmp_path), timeout=200):
        for name in ("SGD momentum", "Adam (L2)"):
            dl, dw, ds = r[name]
            assert dl < TOL and dw < TOL and ds < TOL, (name, dl, dw, ds)
        assert r["mismatch"] is not None and "SGD" in r["mismatch"], r["mismatch"]
        assert "AdamW" in r["mismatch"] and "--no-load-optim" in r["mismatch"]
        assert r["mismatch_sd"] is not None and "saved by SGD" in r["mismatch_sd"]
        assert "AdamW" in r["mismatch_sd"], r["mismatch_sd"]
        assert r["nvme"] is not None and "nvme" in r["nvme"] and "SGD" in r["nvme"], r["nvme"]


def _engine_world(rank, world_size):
    """megazero.initialize: the config's optimizer block (DeepSpeed applies its settings to every
    parameter passed, no decay exemption; no clipping by default) or a client optimizer."""
    import megazero

    batches = make_batches(3, BATCH, SEQ, VOCAB)
    rows = BATCH // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    cases = [
        ("json Adam adam_w_mode false", {"type": "Adam", "params": {
            "lr": 1e-2, "weight_decay": WD, "adam_w_mode": False}}, None,
         lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=WD)),
        ("json SGD", {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9, "nesterov": True,
                                                "weight_decay": WD}}, None,
         lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, nesterov=True, weight_decay=WD)),
        ("client SGD", None, lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.5),
         lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.5)),
    ]
    out = {}
    for name, block, client, plain in cases:
        ref = _tiny()
        opt = plain(ref.parameters())
        for tokens, labels in batches:
            opt.zero_grad()
            ref(tokens, labels).mean().backward()
            opt.step()
        cfg = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        if block is not None:
            cfg["optimizer"] = block
        model = _tiny()
        engine, zero, _, _ = megazero.initialize(model=model, model_parameters=model.parameters(),
                                                 optimizer=client, config=cfg)
        for tokens, labels in batches:
            engine.backward(engine(tokens[mine], labels[mine]).mean())
            engine.step()
        names = {id(p): n for n, p in model.named_parameters()}
        full = {names[k]: v for k, v in zero.full_parameters().items()}
        out[name] = (type(zero.masters.optimizer).__name__,
                     _diff(full, {n: p.detach() for n, p in ref.named_parameters()}))
    return out


def test_engine_runs_the_configured_or_given_optimizer():
    for r in run_distributed(_engine_world, 2, timeout=200):
        assert r["json Adam adam_w_mode false"][0] == "Adam"
        assert r["json SGD"][0] == "SGD" and r["client SGD"][0] == "SGD"
        for name, (_, dw) in r.items():
            assert dw < TOL, (name, dw)


@pytest.mark.parametrize("argv, ds, kind", [
    (["--optimizer", "sgd"], None, "SGD"),
    (["--optimizer", "sgd", "--sgd-momentum", "0"], None, "SGD"),
    ([], {"optimizer": {"type": "Lion"}, "train_batch_size": "auto"}, "Lion"),
    ([], {"optimizer": {"type": "Lamb"}, "train_batch_size": "auto"}, "Lamb")])
def test_planner_counts_each_optimizers_state(argv, ds, kind):
    """The planner's optimizer bytes equal what the engine holds after a step (SGD: one buffer,
    none without momentum, no step counter; Lion: one moment, no step; Adam is checked in
    test_planner_model_states)."""
    from dataclasses import replace

    from megazero.distributed.topology import ParallelTopology
    from megazero.planner.model_states import model_state_report
    from megazero.planner.shapes import meta_chunks, shape_topology
    from megazero.training.builders import build_model_and_optimizer

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--vocab-size 100 --micro-batch-size 1 --train-iters 1").split()
    cfg = load_config(base + argv, 1, ds_config=ds)
    for stage, offload in ((1, CPU), (2, OffloadConfig()), (3, OffloadConfig())):
        cfg = replace(cfg, zero=replace(cfg.zero, stage=stage, sub_group_size=1000,
                                        offload_optimizer=offload))
        topo = ParallelTopology.single()
        _, engine = build_model_and_optimizer(cfg, topo, torch.device("cpu"))
        assert engine.masters.kind.name == kind
        engine.masters.step(1.0)
        held = engine.memory_report()["bytes"]["optimizer"]
        chunks = meta_chunks(cfg, shape_topology(cfg.layout(), 0, 0, 0))
        predicted = model_state_report(chunks, cfg.zero, cfg.precision, dp=1,
                                       optimizer=cfg.optimizer).bytes["optimizer"]
        assert held == predicted, (argv, stage)


# ---------------------------------------------------------------- config: JSON and flags

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def _load(ds=None, argv=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(MODEL + list(argv), 2, ds_config=ds).optimizer


@pytest.mark.parametrize("block, kind", [
    ({"type": "Adam", "params": {"lr": 1e-3}}, "adamw"),  # DeepSpeed: adam_w_mode defaults on
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "adam"),
    ({"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}}, "adam"),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, "adamw"),  # AdamW is always decoupled
    ({"type": "SGD", "params": {"lr": 0.1}}, "sgd"),
    ({"type": "Lion", "params": {"lr": 1e-4}}, "lion"),
    ({"type": "Lamb", "params": {"lr": 1e-4}}, "lamb"),
])
def test_json_optimizer_type(block, kind):
    assert _load({"optimizer": block}).optimizer == kind


def test_json_sgd_params_and_megatron_flags():
    o = _load({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.8,
                                                       "nesterov": True, "weight_decay": 0.01}}})
    assert (o.sgd_momentum, o.sgd_nesterov, o.sgd_dampening, o.weight_decay, o.lr) == (
        0.8, True, 0.0, 0.01, 0.1)
    o = _load(argv=["--optimizer", "sgd", "--sgd-momentum", "0.5"])
    assert (o.optimizer, o.sgd_momentum) == ("sgd", 0.5)
    assert _load(argv=["--optimizer", "adam"]).optimizer == "adamw"  # Megatron's adam decouples
    assert _load().sgd_momentum == 0.9  # Megatron's --sgd-momentum default
    o = _load({"optimizer": {"type": "Lion", "params": {"weight_decay": 1.0}}})
    assert (o.adam_beta1, o.adam_beta2, o.weight_decay) == (0.9, 0.99, 1.0)  # DeepSpeed's betas
    o = _load({"optimizer": {"type": "Lion", "params": {"betas": [0.95, 0.98]}}})
    assert (o.adam_beta1, o.adam_beta2) == (0.95, 0.98)


@pytest.mark.parametrize("block, parts", [
    ({"type": "SGD", "params": {"betas": [0.9, 0.99]}}, ["optimizer.params.betas", "'SGD'"]),
    ({"type": "AdamW", "params": {"momentum": 0.9}}, ["optimizer.params.momentum", "SGD"]),
    ({"type": "Lion", "params": {"eps": 1e-8}}, ["optimizer.params.eps", "'Lion'"]),
    ({"type": "Adagrad"}, ["optimizer.type", "'Adagrad'", "ZeroOneAdam and OneBitLamb"]),
    ({"type": "AdamW", "params": {"max_coeff": 5.0}}, ["optimizer.params.max_coeff", "Lamb"]),
    ({"type": "Adam", "params": {"bias_correction": False}},
     ["optimizer.params.bias_correction", "only Lamb"]),
])
def test_json_optimizer_rejections(block, parts):
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(MODEL, 2, ds_config={"optimizer": block})
    assert all(p in str(e.value) for p in parts), str(e.value)
