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
    """A plain module: embedding, MLP block with a norm, output head; returns the loss.

    Shaped like a user's Hugging Face-style module, unlike :class:`megazero.testing.reference.
    TinyLM` (``GPTModel``'s signature: per-token losses, tied embedding): ``model(ids,
    labels=ids)`` returns the mean next-token loss, and the untied head has a bias that the
    engine tests modify through ``GatheredParameters``."""

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

        from megazero.testing.hf_models import gpt2_config

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
            if rank:  # other ranks start elsewhere: initialize takes rank 0's weights
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
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
