"""Measure the activation bytes autograd keeps for backward, and Megatron's formulas for them.

Measured, not assumed: :class:`SavedTensorCounter` records every tensor autograd saves (through
``torch.autograd.graph.saved_tensors_hooks``, which also sees tensors saved by custom autograd
functions and by :func:`megazero.tensor_parallel.random.checkpoint`) and counts the bytes of
distinct memory they cover. Views of one buffer (Q, K and V slices of the fused QKV output) are
counted once per byte actually covered; parameters and module buffers are state, not
activations, and count zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensorCounter:
    """Context manager collecting the tensors saved for backward inside it."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.saved: list[torch.Tensor] = []
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def bytes_by_storage(self) -> dict[int, int]:
        """Distinct bytes covered, per storage (excluded storages omitted)."""
        covered: dict[int, tuple[torch.Tensor, int]] = {}
        for t in self.saved:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._excluded or t.numel() == 0:
                continue
            if ptr not in covered:
                covered[ptr] = (torch.zeros(storage.nbytes(), dtype=torch.bool), 0)
            mask = covered[ptr][0]
            size = t.element_size()
            elems = torch.arange(storage.nbytes() // size).as_strided(
                t.shape, t.stride(), t.storage_offset()).reshape(-1)
            byte_idx = (elems.unsqueeze(1) * size + torch.arange(size)).reshape(-1)
            mask[byte_idx] = True
        return {ptr: int(mask.sum()) for ptr, (mask, _) in covered.items()}

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_storage().values())


def measure_saved_bytes(module: torch.nn.Module, *inputs) -> int:
    """Bytes of activations ``module(*inputs)`` keeps for backward (runs one forward)."""
    state = [*module.parameters(), *module.buffers()]
    with SavedTensorCounter(exclude=state) as counter:
        module(*inputs)
    return counter.total_bytes


def megatron_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                    sequence_parallel: bool = False,
                                    selective: bool = False) -> float:
    """Per-layer activation bytes of Korthikanti et al. (2022) / DESIGN.md section 3:
    16-bit activations, 1-byte dropout masks.

    no TP: ``sbh(34 + 5as/h)``; TP: ``sbh(10 + 24/t + 5as/(ht))``; TP+SP: ``sbh(34 + 5as/h)/t``;
    selective recomputation drops the ``5as/h`` attention term.
    """
    attn = 0.0 if selective else 5.0 * a * s / h
    if t == 1:
        return s * b * h * (34 + attn)
    if sequence_parallel:
        return s * b * h * (34 + attn) / t
    return s * b * h * (10 + 24 / t + attn / t)


CASES = (  # (name, tp, sequence_parallel, selective recompute)
    ("no TP", 1, False, False),
    ("TP", None, False, False),
    ("TP+SP", None, True, False),
    ("TP+SP+selective", None, True, True),
)


def measure_layer_cases(rank: int, world: int, s: int, b: int, h: int, a: int,
                        tp: int, attention_backend: str = "unfused",
                        attention_dropout: float = 0.1) -> list[dict]:
    """Per-layer saved bytes of a gpt2-preset layer (LayerNorm, GELU, biases, dropout 0.1,
    unfused core attention unless ``attention_backend`` says otherwise, bf16) for the four
    cases of Megatron's table, next to the formula.

    Run on every rank of a world of ``tp`` ranks (e.g. with ``run_distributed``): the TP cases
    communicate. Returns rank 0's measurements (every rank measures the same sizes).
    """
    from megazero.config import ModelConfig, RecomputeConfig
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel.context import ParallelContext

    cfg = ModelConfig.preset("gpt2", num_layers=1, hidden_size=h, num_attention_heads=a,
                             seq_length=s, vocab_size=100, attention_dropout=attention_dropout,
                             hidden_dropout=0.1)
    tp_topo = ParallelTopology.build(tp=tp)
    rows = []
    for name, t, sp, selective in CASES:
        t = tp if t is None else t
        topo = tp_topo if t > 1 else ParallelTopology.single()
        parallel = ParallelContext.from_topology(topo, sequence_parallel=sp,
                                                 params_dtype=torch.bfloat16,
                                                 attention_backend=attention_backend)
        model = GPTModel(cfg, topo, parallel=parallel,
                         recompute=RecomputeConfig("selective" if selective else None))
        layer = model.decoder.layers["0"]
        x = torch.randn(s // t if sp else s, b, h, dtype=torch.bfloat16, requires_grad=True)
        measured = measure_saved_bytes(layer, x)
        formula = megatron_layer_activation_bytes(s, b, h, a, t, sp, selective)
        rows.append(dict(case=name, attention_backend=attention_backend,
                         attention_dropout=attention_dropout, s=s, b=b, h=h, a=a,
                         t=t, measured_bytes=measured, formula_bytes=formula,
                         ratio=measured / formula))
    return rows
