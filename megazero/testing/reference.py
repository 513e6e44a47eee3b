"""A tiny stand-in language model and the single-process reference loop the ZeRO engine must
match, and the ZeRO paper's model-state bytes to compare its accounting with (used by the
tests and benchmarks).

The model has what matters to ZeRO: an embedding tied to the output projection (used outside
the module that owns it, like a GPT's tied word embedding), matrices and vectors (weight decay on
the former only), and several modules so that stage 3 gathers and releases layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import OptimizerConfig


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return out


class TinyLM(nn.Module):
    """``forward(tokens [b, s], labels [b, s]) -> per-token loss [b, s]`` like ``GPTModel``."""

    def __init__(self, vocab: int = 64, hidden: int = 16, layers: int = 2, seed: int = 0,
                 tied: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embedding = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden)
        self.output = None if tied else nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.1)
                        + (1.0 if p.ndim == 1 and p.shape[0] == hidden else 0.0))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        w = self.embedding.weight if self.output is None else self.output.weight
        logits = F.linear(x, w).float()
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def make_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def torch_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """The plain torch optimizer the engine must reproduce (no decay on ``ndim < 2``)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups,
                             lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, foreach=True)


def reference_run(make_model: Callable[[], nn.Module],
                  batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: OptimizerConfig
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, full batch, ``torch.optim.AdamW`` + ``clip_grad_norm_``."""
    model = make_model()
    opt = torch_adamw(model, cfg)
    losses = []
    for tokens, labels in batches:
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_train_step(model: nn.Module, engine: Any, tokens: torch.Tensor, labels: torch.Tensor,
                      micro_batches: int = 1) -> tuple[float, Any]:
    """One data-parallel step on this rank's rows; returns (loss averaged over dp, result).

    Every micro-batch's loss is its token mean divided by the number of micro-batches, so the
    accumulated gradient is that of the mean over the rank's rows; the dp average of the
    gradients then equals the full batch's.
    """
    engine.zero_grad()
    total = 0.0
    rows = tokens.shape[0] // micro_batches
    for i in range(micro_batches):
        sl = slice(i * rows, (i + 1) * rows)
        ctx = engine.no_sync() if i < micro_batches - 1 else nullcontext()
        with ctx:
            loss = model(tokens[sl], labels[sl]).float().mean() / micro_batches
            engine.backward(loss)
        total += loss.item()
    engine.finish_grad_sync()
    return total, engine.step()


def formula_bytes(stage: int, numel: int, dp: int, mixed: bool, offload: bool = False) -> float:
    """ZeRO paper's model-state bytes per rank (Adam): K = 12 mixed, 8 in fp32 (masters = params).

    With the optimizer offloaded, fp32 training needs a host copy of the master weights too
    (the device keeps the parameters it computes with), so K = 12 there as well.
    """
    p = g = 2 if mixed else 4
    k = 12 if mixed or offload else 8
    n = float(dp)
    per = {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
    return per * numel
