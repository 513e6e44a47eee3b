"""Rank functions and one-process references for the engine API tests (tests/test_engine_*.py).

Every run draws the same global batches (seeded); rank ``r`` of ``dp`` takes rows
``[(r * gas + m) * micro, ... + micro)`` of a step's batch at micro-step ``m``, so the union over
ranks and micro-steps is the whole batch, which the reference trains on in one piece.
"""

from __future__ import annotations

import copy
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
    zero = {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500,
            "stage3_param_persistence_threshold": 0}
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


def reference_losses(kind: str, steps: int, dp: int, seed: int = 0) -> list[float]:
    """One process, the whole global batch, torch.optim.AdamW + clip_grad_norm_."""
    model = build(kind, seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD)
    data = batches(steps, MICRO * GAS * dp)
    out = []
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        loss = loss_of(kind, model, data[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def train_steps(engine, kind: str, data: torch.Tensor, first: int, steps: int, rank: int
                ) -> list[float]:
    """Run ``steps`` optimizer steps from ``first``; the mean micro-batch loss of each step."""
    out = []
    for s in range(first, first + steps):
        mine = []
        for m in range(GAS):
            lo = (rank * GAS + m) * MICRO
            loss = loss_of(kind, engine, data[s, lo:lo + MICRO])
            engine.backward(loss)
            assert engine.is_gradient_accumulation_boundary() == (m == GAS - 1)
            engine.step()
            mine.append(loss.item())
        out.append(mine)
    return out


def mean_over_ranks(per_rank: list[list[list[float]]]) -> list[float]:
    steps = len(per_rank[0])
    return [sum(sum(r[s]) for r in per_rank) / sum(len(r[s]) for r in per_rank)
            for s in range(steps)]


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


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
