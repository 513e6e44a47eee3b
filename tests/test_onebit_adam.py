"""1-bit Adam (DeepSpeed's "type": "OneBitAdam") at ZeRO stage 0 on 4 gloo ranks driving the
real GPTModel: up to freeze_step it is AdamW on the averaged gradients (losses and weights equal
the one-process torch AdamW loop to fp32 rounding); after it the gradients stay local, the
momenta cross the data-parallel group compressed, and the engine's per-step communication log
shows 1/32 of the warm-up's fp32 gradient all-reduce plus the scales. Other ZeRO stages and the
1-bit types megazero does not implement are refused in one line."""

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from megazero.config import (
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    ZeroConfig,
    load_config,
)
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.optim.onebit import OneBitAdam
from megazero.tensor_parallel import full_model_state_dict
from megazero.testing import run_distributed
from megazero.testing.reference import torch_adamw
from megazero.zero import build_zero_optimizer

SEQ, VOCAB, HIDDEN, ROWS, FREEZE, STEPS = 16, 96, 32, 8, 3, 8
OPT = OptimizerConfig(optimizer="onebitadam", lr=3e-3, weight_decay=0.1, clip_grad=0.0,
                      adam_eps=1e-6, freeze_step=FREEZE)
TOL, WTOL = 2e-5, 1e-4  # as tests/test_zero_gpt.py


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


def reference():
    """torch AdamW, one process, whole batch: losses of every step, weights after the warm-up."""
    model = GPTModel(gpt_config(), ParallelTopology.single())
    opt = torch_adamw(model, OPT)
    losses, warm = [], None
    for i, (tokens, labels) in enumerate(batches()):
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i + 1 == FREEZE:
            warm = {k: v.clone() for k, v in full_model_state_dict(
                model, ParallelTopology.single()).items()}
    return losses, warm


def _world(rank, world_size):
    topo = ParallelTopology.build()
    ref_losses, ref_warm = reference()
    model = GPTModel(gpt_config(), topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), topo)
    opt = engine.masters.optimizer
    assert type(opt) is OneBitAdam
    rows = ROWS // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    losses, comm, werr = [], [], None
    for i, (tokens, labels) in enumerate(batches()):
        engine.zero_grad()
        loss = model(tokens[mine], labels[mine]).mean()
        engine.backward(loss)
        engine.finish_grad_sync()
        assert engine.step().updated
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)
        losses.append(t.item() / topo.dp_size)
        comm.append(engine.comm_report()["logical_bytes"])
        if i + 1 == FREEZE:
            w = full_model_state_dict(model, topo)
            werr = max(((w[k] - ref_warm[k]).abs().max() / ref_warm[k].abs().max()).item()
                       for k in ref_warm)
    c = opt.compress
    return losses, ref_losses, werr, comm, (c.sign_bytes, c.scale_bytes, c.fp32_bytes)


def test_onebit_adam_warmup_is_adamw_then_one_bit_per_element():
    for losses, ref, werr, comm, (signs, scales, fp32) in run_distributed(_world, 4,
                                                                          timeout=300):
        # warm-up: AdamW (the loss after the last warm-up step is still AdamW's)
        assert max(abs(a - b) for a, b in zip(losses[:FREEZE + 1], ref)) < TOL
        assert werr < WTOL, werr
        # compressed phase: trains on (the loss keeps falling like Adam's, not equal to it)
        assert losses[-1] < losses[FREEZE] and abs(losses[-1] - ref[-1]) < 0.05 * ref[-1]
        for step in comm[:FREEZE]:
            assert "dp/compressed_allreduce" not in step and step["dp/all_reduce"] > 0
        full = comm[0]["dp/all_reduce"]  # the warm-up's fp32 gradient all-reduce
        for step in comm[FREEZE:]:
            assert "dp/all_reduce" not in step, step  # gradients stay local
            step_signs = step["dp/compressed_allreduce"] - scales  # counters: the last step
            assert abs(step_signs / (full / 32) - 1) < 0.05, (step_signs, full / 32)
        assert abs(signs / (fp32 / 32) - 1) < 0.05


def test_onebit_adam_stages_and_types():
    """ZeRO 1-3 are refused for the 1-bit optimizers before any process group exists; pasted
    OneBitAdam, ZeroOneAdam and OneBitLamb blocks (as DeepSpeed's docs write them) set their
    parameters."""
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4".split()

    def load(ds, extra=()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_config(argv + list(extra), 2, ds_config=ds)

    block = {"type": "OneBitAdam", "params": {
        "lr": 2e-4, "freeze_step": 400, "cuda_aware": False, "comm_backend_name": "nccl",
        "bias_correction": False}}
    o = load({"optimizer": block}).optimizer
    assert (o.optimizer, o.freeze_step, o.lr, o.bias_correction) == ("onebitadam", 400, 2e-4,
                                                                      False)
    o = load({"optimizer": {"type": "ZeroOneAdam", "params": {
        "lr": 1e-3, "var_freeze_step": 1000, "var_update_scaler": 16, "local_step_scaler": 1000,
        "local_step_clipper": 16, "cuda_aware": False, "comm_backend_name": "nccl"}}}).optimizer
    assert (o.optimizer, o.var_freeze_step, o.var_update_scaler, o.local_step_scaler,
            o.local_step_clipper) == ("zerooneadam", 1000, 16, 1000, 16)
    o = load({"optimizer": {"type": "OneBitLamb", "params": {
        "lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3,
        "min_coeff": 0.01, "freeze_step": 1000, "cuda_aware": False,
        "comm_backend_name": "nccl", "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
        "factor_threshold": 0.1}}}).optimizer
    assert (o.optimizer, o.freeze_step, o.lamb_max_coeff, o.coeff_beta, o.factor_max,
            o.factor_min, o.factor_threshold) == ("onebitlamb", 1000, 0.3, 0.9, 4.0, 0.5, 0.1)
    for ds, parts in (
            ({"optimizer": block, "zero_optimization": {"stage": 2}},
             ["OneBitAdam runs without ZeRO", "stage 0", "stage 2"]),
            ({"optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 1}},
             ["ZeroOneAdam runs without ZeRO", "stage 0", "stage 1"]),
            ({"optimizer": {"type": "OneBitLamb"}, "zero_optimization": {"stage": 3}},
             ["OneBitLamb runs without ZeRO", "stage 0", "stage 3"])):
        with pytest.raises(ConfigError) as e:
            load(ds)
        assert all(p in str(e.value) for p in parts) and "\n" not in str(e.value), str(e.value)


def test_pretrain_gpt_runs_a_pasted_onebit_adam_config(tmp_path):
    """pretrain_gpt.py on 2 ranks with DeepSpeed's OneBitAdam block as its docs write it: the
    JSON log carries the compressed exchange's bytes from the first step after freeze_step, 1/32
    of the fp32 all-reduce of the same momenta (within 5%, padding) plus the scales."""
    import json

    from megazero.testing.launch import TINY, check, read_metrics, run_training

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_batch_size": "auto", "gradient_clipping": 1.0, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "OneBitAdam", "params": {
            "lr": 3e-3, "weight_decay": 0.01, "bias_correction": False, "freeze_step": 3,
            "cuda_aware": False, "comm_backend_name": "nccl"}}}))
    log = tmp_path / "m.jsonl"
    check(run_training([*TINY, "--train-iters", "5", "--deepspeed_config", str(ds),
                        "--log-json", str(log)], nproc=2))
    m = read_metrics(log)
    assert all("compressed-allreduce-bytes" not in m[i] for i in (1, 2, 3))
    for i in (4, 5):
        sent, scales, fp32 = (m[i][k] for k in ("compressed-allreduce-bytes",
                                                "compressed-scale-bytes", "fp32-allreduce-bytes"))
        assert abs((sent - scales) / (fp32 / 32) - 1) < 0.05, m[i]
        assert scales < 0.1 * sent
    assert all(math.isfinite(m[i]["lm loss"]) for i in m)


def _train(model, engine, topo, data):
    rows = ROWS // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    losses = []
    for tokens, labels in data:
        engine.zero_grad()
        loss = model(tokens[mine], labels[mine]).mean()
        engine.backward(loss)
        engine.finish_grad_sync()
        assert engine.step().updated
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)
        losses.append(t.item() / topo.dp_size)
    return losses


def _resume_world(rank, world_size, root):
    """Save in the compressed phase at dp 4, resume at dp 4: the same numbers as not stopping
    (moments and every rank's error buffers restored, gradients local from the first step). At
    dp 2 (tp 2) the load is refused in one line; with --no-load-optim it loads the weights."""
    from megazero.checkpoint import load_checkpoint, save_checkpoint
    from megazero.errors import CheckpointError

    data = batches()
    topo = ParallelTopology.build()
    model = GPTModel(gpt_config(), topo)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), topo)
    _train(model, engine, topo, data[:FREEZE + 2])
    save_checkpoint(root, FREEZE + 2, topo, models=[model], optimizer=engine, scheduler=None,
                    consumed_samples=0, config={}, zero_stage=0)
    straight = _train(model, engine, topo, data[FREEZE + 2:])
    model = GPTModel(gpt_config(), topo)  # same init: the load must overwrite what it trained
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), topo)
    load_checkpoint(root, topo, models=[model], optimizer=engine, scheduler=None, zero_stage=0)
    resumed = _train(model, engine, topo, data[FREEZE + 2:])
    tp2 = ParallelTopology.build(tp=2)
    model = GPTModel(gpt_config(), tp2)
    engine = build_zero_optimizer([model], OPT, ZeroConfig(stage=0), PrecisionConfig(), tp2)
    try:
        load_checkpoint(root, tp2, models=[model], optimizer=engine, scheduler=None,
                        zero_stage=0)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    load_checkpoint(root, tp2, models=[model], optimizer=engine, scheduler=None, zero_stage=0,
                    no_load_optim=True)
    return straight, resumed, refused


def test_onebit_adam_resumes_with_its_error_feedback(tmp_path):
    for straight, resumed, refused in run_distributed(_resume_world, 4, str(tmp_path),
                                                      timeout=300):
        assert max(abs(a - b) for a, b in zip(straight, resumed)) < 1e-6, (straight, resumed)
        assert refused is not None and "\n" not in refused
        assert all(p in refused for p in ("error-feedback", "dp 4", "dp 2", "--no-load-optim"))
