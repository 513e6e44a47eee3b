"""Rank functions and one-process references for the engine API tests (tests/test_engine_*.py).

Every run draws the same global batches (seeded); rank ``r`` of ``dp`` takes rows
``[(r * gas + m) * micro, ... + micro)`` of a step's batch at micro-step ``m``, so the union over
ranks and micro-steps is the whole batch, which the reference trains on in one piece.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HIDDEN = 100, 8, 32
MICRO, GAS = 2, 2
LR, WD, CLIP, BETAS = 1e-2, 0.01, 0.5, (0.9, 0.99)
WARMUP, LR_MIN = 3, 2e-3


class TinyLM(nn.Module):
    """A plain module: embedding, MLP block with a norm, output head; returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "hf":
        import transformers

        from tests.hf_models import gpt2_config

        return transformers.GPT2LMHeadModel(gpt2_config(n_positions=SEQ))
    return TinyLM()


def loss_of(kind: str, model_or_engine, ids: torch.Tensor) -> torch.Tensor:
    if kind == "hf":
        return model_or_engine(input_ids=ids, labels=ids).loss
    return model_or_engine(ids, labels=ids)


def batches(steps: int, gbs: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, gbs, SEQ), generator=g)


def lr_at(step: int) -> float:
    """DeepSpeed WarmupLR, linear warm-up, as the engine steps it (step k uses f(k - 1))."""
    it = step - 1
    if it < 0:
        return LR_MIN
    return LR_MIN + (LR - LR_MIN) * min(1.0, it / WARMUP)


def ds_config(stage: int, offload: bool = False, **extra) -> dict:
    # small buckets: several per step; units under 200 elements (biases, norms) stay whole,
    # the matrices are partitioned (fewer tiny collectives: the CPU suite is latency-bound)
    # stage 3 releases every unit after its forward (reuse distance 0): a parameter used outside
    # its module (GPT-2's tied embedding) must be gathered for it
    zero = {"stage": stage, "reduce_bucket_size": 4000, "allgather_bucket_size": 4000,
            "stage3_param_persistence_threshold": 200, "stage3_max_reuse_distance": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "train_batch_size": "auto", "gradient_clipping": CLIP, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD,
                                                      "betas": list(BETAS), "eps": 1e-8}},
            "scheduler": {"type": "WarmupLR", "params": {
                "warmup_min_lr": LR_MIN, "warmup_max_lr": LR, "warmup_num_steps": WARMUP,
                "warmup_type": "linear"}},
            "zero_optimization": zero, **extra}


def reference_losses(kind: str, steps: int, dp: int, seed: int = 0, modify=None,
                     norms: list[float] | None = None, optim=None) -> list[float]:
    """One process, the whole global batch, torch.optim.AdamW + clip_grad_norm_; ``optim``:
    ``model -> (optimizer, scheduler)`` instead of AdamW with the WarmupLR of ``lr_at``."""
    model = build(kind, seed)
    if modify is not None:
        with torch.no_grad():
            modify(model)
    model.train()
    if optim is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8,
                                weight_decay=WD)
        sched = None
    else:
        opt, sched = optim(model)
    data = batches(steps, MICRO * GAS * dp)
    out = []
    for s in range(steps):
        if optim is None:
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
        loss = loss_of(kind, model, data[s])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if norms is not None:
            norms.append(norm.item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def client_optim(model: nn.Module):
    """Hugging Face Trainer's shape: AdamW with a decay and a no-decay group, LambdaLR."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=LR, betas=BETAS)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def json_optim_step_lr(model: nn.Module):
    """The config's AdamW with a StepLR built by a callable (``lr_scheduler=callable``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def client_and_bf16_world(rank: int, world: int) -> dict:
    """A client optimizer + scheduler object (stage 3), the config's optimizer + a scheduler
    callable (stage 1), and bf16 (stage 2)."""
    import megazero

    out: dict = {}
    data = batches(3, MICRO * GAS * world)
    no_opt = {k: v for k, v in ds_config(3).items() if k not in ("optimizer", "scheduler")}
    model = build("plain")
    opt, sched = client_optim(model)
    engine, _, _, s = megazero.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                          config=no_opt)
    assert s is sched
    out["client"] = train_steps(engine, "plain", data, 0, 3, rank)
    out["client_lrs"] = engine.get_lr()
    no_sched = {k: v for k, v in ds_config(1).items() if k != "scheduler"}
    model = build("plain")
    engine, _, _, s = megazero.initialize(
        model=model, config=no_sched,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert isinstance(s, torch.optim.lr_scheduler.StepLR)
    out["callable"] = train_steps(engine, "plain", data, 0, 3, rank)
    out["callable_lrs"] = engine.get_lr()
    model = build("plain")
    engine, zero, _, _ = megazero.initialize(model=model,
                                             config=ds_config(2, bf16={"enabled": True}))
    out["bf16_dtypes"] = ({str(p.dtype) for p in model.parameters()},
                          {str(pc.master.dtype) for pc in zero.masters.pieces})
    out["bf16"] = train_steps(engine, "plain", data, 0, 3, rank)
    from megazero.zero import GatheredParameters

    # stage 2 holds full weights: no gather, but rank 0's change reaches every rank and the
    # fp32 masters (which would otherwise overwrite it at the next step)
    with GatheredParameters([model.head.bias], modifier_rank=0):
        model.head.bias.data.fill_(0.5 if rank == 0 else -1.0)
    out["bf16_modified"] = (model.head.bias.float().unique().tolist(),
                            sorted({v for pc in zero.masters.pieces if pc.param is model.head.bias
                                    for v in pc.master.unique().tolist()}))
    return out


def train_steps(engine, kind: str, data: torch.Tensor, first: int, steps: int, rank: int,
                micro: int = MICRO, gas: int = GAS) -> list[list[float]]:
    """Run ``steps`` optimizer steps from ``first``; each step's micro-batch losses."""
    out = []
    for s in range(first, first + steps):
        mine = []
        for m in range(gas):
            lo = (rank * gas + m) * micro
            loss = loss_of(kind, engine, data[s, lo:lo + micro])
            engine.backward(loss)
            assert engine.is_gradient_accumulation_boundary() == (m == gas - 1)
            engine.step()
            mine.append(loss.item())
        out.append(mine + [engine.get_global_grad_norm()])
    return out


def mean_over_ranks(per_rank: list[list[list[float]]]) -> list[float]:
    """Each step's loss over the whole batch (``train_steps`` rows end with the grad norm)."""
    steps = len(per_rank[0])
    return [sum(sum(r[s][:-1]) for r in per_rank) / sum(len(r[s]) - 1 for r in per_rank)
            for s in range(steps)]


def grad_norms(per_rank: list[list[list[float]]]) -> list[float]:
    """Each step's global gradient norm (the same on every rank: checked)."""
    norms = [row[-1] for row in per_rank[0]]
    assert all([row[-1] for row in r] == norms for r in per_rank)
    return norms


def equivalence_world(rank: int, world: int, kinds: tuple[str, ...], cases: list, steps: int
                      ) -> dict:
    """Every (kind, stage, offload) case in sequence in one world: losses and step checks."""
    import megazero

    out = {}
    data = batches(steps, MICRO * GAS * world)
    for kind in kinds:
        for stage, offload in cases:
            model = build(kind)
            engine, opt, _, sched = megazero.initialize(
                model=model, model_parameters=model.parameters(),
                config=ds_config(stage, offload))
            assert engine.train_batch_size() == MICRO * GAS * world
            assert engine.zero_optimization_stage() == stage
            losses = train_steps(engine, kind, data, 0, steps, rank)
            assert engine.global_steps == steps and engine.global_samples == steps * MICRO * \
                GAS * world, (engine.global_steps, engine.global_samples)
            assert math.isclose(engine.get_lr()[0], lr_at(steps), rel_tol=1e-12)
            out[(kind, stage, offload)] = losses
    return out


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
    expect_cfg("sgd", config=no_opt, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
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

    def fresh():
        m = build("plain", seed=5)  # another init: loading must overwrite every weight
        return megazero.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]

    if phase == "save":
        engine = fresh()
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
        engine = fresh()
        path, client = engine.load_checkpoint(root, tag="step2")
        out["path"], out["client"] = path, {**client, "t": client["t"].tolist()}
        out["counters"] = (engine.global_steps, engine.global_samples, engine.micro_steps)
        out["resumed"] = train_steps(engine, "plain", data, 2, 2, rank, micro, gas)
        out["resumed_lr4"] = engine.get_lr()
        engine = fresh()
        _, latest = engine.load_checkpoint(root)
        out["latest_client"], out["latest_steps"] = latest, engine.global_steps
    else:
        engine = fresh()
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
    torch.manual_seed(0)
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
