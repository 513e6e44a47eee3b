"""Rank functions for the engine tests that check state rather than loss equivalence: fp16
overflow skipping, out-of-order calls and config errors, checkpoints, zero.Init (see
megazero/testing/engine_runs.py for the models, data split and references)."""

from __future__ import annotations

import torch
from torch import nn

from megazero.testing.engine_runs import (
    GAS,
    MICRO,
    TinyLM,
    batches,
    build,
    ds_config,
    loss_of,
    train_steps,
)


def full_params(engine) -> dict[str, torch.Tensor]:
    from megazero.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def fp16_and_errors_world(rank: int, world: int) -> dict:
    """fp16 overflow skip (rank 1 injects inf), then out-of-order calls, then config errors."""
    import megazero
    from megazero.config import ConfigError
    from megazero.engine import EngineStateError

    out: dict = {}
    data = batches(4, MICRO * GAS * world)
    model = build("plain")
    cfg = ds_config(2, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
                    steps_per_print=1, wall_clock_breakdown=True)
    engine, _, _, _ = megazero.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
    lines: list[str] = []
    engine.log_fn = lines.append
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert next(model.parameters()).dtype == torch.float16
    train_steps(engine, "plain", data, 0, 1, rank)
    out["applied0"] = engine.was_step_applied()
    out["scale0"] = engine.loss_scale
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr_before = engine.get_lr()
    for m in range(GAS):
        lo = (rank * GAS + m) * MICRO
        loss = loss_of("plain", engine, data[1, lo:lo + MICRO])
        if rank == 1 and m == 0:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
    out["applied1"] = engine.was_step_applied()
    out["scale1"] = engine.loss_scale
    out["unchanged1"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    out["lr_held"] = engine.get_lr() == lr_before
    out["skipped"], out["global_steps"] = engine.skipped_steps, engine.global_steps
    train_steps(engine, "plain", data, 2, 1, rank)
    out["applied2"] = engine.was_step_applied()
    out["changed2"] = not all(torch.equal(before[n], p) for n, p in model.named_parameters())
    out["lr_moved"] = engine.get_lr() != lr_before
    out["log"] = lines

    # --- out-of-order calls -----------------------------------------------------------------
    model = build("plain")
    engine, _, _, _ = megazero.initialize(model=model, config=ds_config(1))
    errors = {}

    def expect(name, fn):
        try:
            fn()
        except EngineStateError as e:
            errors[name] = str(e)

    expect("step_without_backward", engine.step)
    ids = data[0, :MICRO]
    engine.backward(loss_of("plain", engine, ids))
    expect("backward_twice", lambda: engine.backward(loss_of("plain", engine, ids)))
    engine.step()  # the engine recovers: the first backward's micro-step completes
    engine.eval()
    eval_loss = loss_of("plain", engine, ids)
    expect("backward_in_eval", lambda: engine.backward(eval_loss))
    engine.train()
    expect("eval_forward_then_backward", lambda: engine.backward(eval_loss))
    with torch.no_grad():
        nograd = loss_of("plain", engine, ids)
    expect("loss_without_grad", lambda: engine.backward(nograd))
    engine.backward(loss_of("plain", engine, ids))
    engine.step()
    out["recovered_steps"] = engine.global_steps
    out["errors"] = errors

    # --- configuration errors ---------------------------------------------------------------
    cfg_errors = {}

    def expect_cfg(name, **kw):
        m = build("plain")
        try:
            megazero.initialize(model=m, **kw)
        except ConfigError as e:
            cfg_errors[name] = str(e)

    one_cycle = ds_config(0)
    one_cycle["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 0.0}}
    expect_cfg("one_cycle", config=one_cycle)
    expect_cfg("optimizer_twice", config=ds_config(0),
               optimizer=lambda ps: torch.optim.AdamW(ps))
    no_opt = {k: v for k, v in ds_config(0).items() if k not in ("optimizer", "scheduler")}
    expect_cfg("rmsprop", config=no_opt, optimizer=lambda ps: torch.optim.RMSprop(ps, lr=0.1))
    expect_cfg("no_optimizer", config=no_opt)
    expect_cfg("bad_triad", config={**ds_config(0), "train_batch_size": 7})
    out["cfg_errors"] = cfg_errors
    return out


def checkpoint_world(rank: int, world: int, root: str, phase: str) -> dict:
    """``save``: dp=world, stage 1; 2 steps, save 'step2' (with client_state), 2 more steps,
    save 'step4'; a fresh engine loads 'step2' and repeats steps 3-4; latest is 'step4'.
    ``reshard``: stage 3 at dp=world (same global batch: micro 1 when world is 4) loads
    'step2' and runs steps 3-4."""
    import megazero

    data = batches(4, 8)
    micro, gas = (MICRO, GAS) if world == 2 else (1, 8 // world)
    cfg = ds_config(1 if phase == "save" else 3, train_micro_batch_size_per_gpu=micro,
                    gradient_accumulation_steps=gas, train_batch_size=8)
    out: dict = {}

    def fresh(seed: int):
        m = build("plain", seed=seed)  # the loading runs start from another init
        with torch.no_grad():
            m.norm.weight.normal_(1.0, 0.2)
        m.norm.requires_grad_(False)  # frozen: saved and loaded, no optimizer state
        return megazero.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]

    if phase == "save":
        engine = fresh(5)
        out["first"] = train_steps(engine, "plain", data, 0, 2, rank, micro, gas)
        from megazero.engine.checkpoint import ClientStateError

        try:
            engine.save_checkpoint(root, tag="bad", client_state={"fn": print})
        except ClientStateError as e:
            out["client_state_error"] = str(e)
        engine.save_checkpoint(root, tag="step2",
                               client_state={"step": 2, "note": "two", "t": torch.arange(3)})
        out["rest"] = train_steps(engine, "plain", data, 2, 2, rank, micro, gas)
        out["lr4"] = engine.get_lr()
        engine.save_checkpoint(root, tag="step4", client_state={"step": 4})
        engine = fresh(7)
        path, client = engine.load_checkpoint(root, tag="step2")
        out["path"], out["client"] = path, {**client, "t": client["t"].tolist()}
        out["counters"] = (engine.global_steps, engine.global_samples, engine.micro_steps)
        out["resumed"] = train_steps(engine, "plain", data, 2, 2, rank, micro, gas)
        out["resumed_lr4"] = engine.get_lr()
        engine = fresh(7)
        _, latest = engine.load_checkpoint(root)
        out["latest_client"], out["latest_steps"] = latest, engine.global_steps
    else:
        engine = fresh(7)
        _, client = engine.load_checkpoint(root, tag="step2")
        out["client"] = {**client, "t": client["t"].tolist()}
        out["resumed"] = train_steps(engine, "plain", data, 2, 2, rank, micro, gas)
        out["resumed_lr4"] = engine.get_lr()
    return out


def init_world(rank: int, world: int) -> dict:
    """zero.Init storage and gathered values, GatheredParameters write-back, stage-3 training
    of the Init-built model."""
    import megazero
    from megazero.zero import GatheredParameters, Init

    out: dict = {}
    torch.manual_seed(rank)  # seeded per rank: the partitioned values are rank 0's
    with Init():
        model = TinyLM()
    params = list(model.parameters())
    out["empty"] = all(p.data.numel() == 0 for p in params)
    out["stored"] = sum(p.mz_shard.numel() for p in params)
    with Init():
        class Late(nn.Module):  # a class defined inside the context is partitioned too
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.arange(5.0))

        late = Late()
    out["late_empty"] = late.w.numel() == 0 and late.w.mz_shard.tolist() == (
        [0.0, 1.0, 2.0] if rank == 0 else [3.0, 4.0, 0.0])
    out["outside_full"] = nn.Linear(3, 3).weight.numel() == 9  # the patches are undone

    class Stack(nn.Module):
        """Records how many parameter elements are held in full after each layer is built."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList()
            self.live = []
            for _ in range(4):
                self.layers.append(nn.Linear(16, 16))
                self.live.append(sum(p.data.numel() for p in self.parameters()))

    with Init():
        stack = Stack()
    out["stack_live"] = stack.live
    # an Init-built model at stage 1: initialize gathers it whole (stages 0-2 hold full weights)
    torch.manual_seed(0)
    with Init():
        model1 = TinyLM()
    engine1, _, _, _ = megazero.initialize(model=model1, config=ds_config(1))
    out["stage1_full"] = {n: p.detach().numpy().copy() for n, p in model1.named_parameters()}
    with GatheredParameters(params):
        out["gathered"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    out["empty_after"] = all(p.data.numel() == 0 for p in params)
    with GatheredParameters(model.head.bias, modifier_rank=0):
        if rank == 0:
            model.head.bias.data.fill_(1.0)
        else:
            model.head.bias.data.fill_(-3.0)  # not the modifier: overwritten by rank 0's
    with GatheredParameters([model.head.bias]):
        out["bias_after"] = model.head.bias.detach().numpy().copy()
    engine, _, _, _ = megazero.initialize(model=model, config=ds_config(3))
    with GatheredParameters(model.head.bias, modifier_rank=0):
        model.head.bias.data.fill_(0.25)
    out["full"] = {n: t.numpy() for n, t in full_params(engine).items()}
    data = batches(2, MICRO * GAS * world)
    out["losses"] = train_steps(engine, "plain", data, 0, 2, rank)
    return out
