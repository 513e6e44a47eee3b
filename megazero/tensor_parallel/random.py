"""Tensor-parallel aware random streams, and activation checkpointing that replays them.

Dropout masks must agree where activations are replicated and differ where they are sharded:

* Replicated activations (hidden dropout without sequence parallelism, embedding dropout)
  draw from the ``default`` stream, seeded identically on every TP rank, so every rank drops
  the same elements and the replicated copies stay identical.
* Sharded activations (attention-probability dropout on this rank's heads, hidden dropout on
  this rank's sequence slice under sequence parallelism) draw from the ``model-parallel``
  stream, seeded ``seed + 2718 + tp_rank`` (Megatron's rule), so ranks draw independent masks
  instead of repeating one mask on every shard.

Streams are stored as generator states and swapped into the global torch generators inside
:meth:`RNGStatesTracker.fork`, because ``F.dropout`` only draws from the global generator.
The tracker is an ordinary object owned by the model (``model.rng_tracker``), never a module
global, so tests and checkpoints can read, reset and restore it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from megazero.tensor_parallel import weight_grad

if TYPE_CHECKING:
    from megazero.tensor_parallel.saved_inputs import SavedInputLayout

DEFAULT_STREAM = "default"
MODEL_PARALLEL_STREAM = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_global_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda_ready() else None)


def _set_global_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None and _cuda_ready():
        torch.cuda.set_rng_state(state[1])


def _seeded_state(seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = None
    if _cuda_ready():
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        cuda = gen.get_state()
    return cpu, cuda


class RNGStatesTracker:
    """Named random streams (CPU and, when initialised, CUDA generator states)."""

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._seeds: dict[str, int] = {}

    @classmethod
    def for_tensor_parallel(cls, seed: int, tp_rank: int) -> RNGStatesTracker:
        """The two streams of a TP rank: ``default`` (same on all TP ranks) and
        ``model-parallel`` (``seed + 2718 + tp_rank``)."""
        tracker = cls()
        tracker.add(DEFAULT_STREAM, seed)
        tracker.add(MODEL_PARALLEL_STREAM, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} already used by another stream of this tracker")
        if name in self._states:
            raise ValueError(f"stream {name!r} already exists")
        self._seeds[name] = seed
        self._states[name] = _seeded_state(seed)

    def reset(self) -> None:
        """Reseed every stream to its initial seed."""
        for name, seed in self._seeds.items():
            self._states[name] = _seeded_state(seed)

    def get_states(self) -> dict[str, Any]:
        """A copy of every stream's state (for checkpoints and recomputation)."""
        return {k: (c.clone(), None if g is None else g.clone())
                for k, (c, g) in self._states.items()}

    def set_states(self, states: dict[str, Any]) -> None:
        unknown = set(states) - set(self._seeds)
        if unknown:
            raise KeyError(f"random streams {sorted(unknown)} not in this tracker "
                           f"({sorted(self._seeds)})")
        self._states = {k: (c.clone(), None if g is None else g.clone())
                        for k, (c, g) in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the global generators are untouched."""
        if name not in self._states:
            raise KeyError(f"unknown random stream {name!r}; have {list(self._states)}")
        cpu, cuda = self._states[name]
        if cuda is None and _cuda_ready():
            # Built before CUDA was initialised (model constructed on CPU, then moved): seed the
            # CUDA stream now, or GPU dropout would silently draw from the global generator.
            self._states[name] = (cpu, _seeded_state(self._seeds[name])[1])
        saved = _get_global_state()
        _set_global_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_global_state()
            _set_global_state(saved)


class _CheckpointFunction(torch.autograd.Function):
    """Run ``fn`` without saving activations; rerun it in backward with the same randomness.

    The inputs are saved with ``save_for_backward`` (so memory accounting through
    ``saved_tensors_hooks`` sees them), and the global generators plus every tracker stream are
    snapshotted before the first run and restored around the recomputation: dropout inside the
    region then draws exactly the masks of the first run, in every TP region. ``saved`` (a
    :class:`~megazero.tensor_parallel.saved_inputs.SavedInputLayout`) says how the first tensor
    input is kept: a tensor-parallel piece of it, on the host.
    """

    @staticmethod
    def forward(ctx, fn, tracker, saved, *args):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.global_state = _get_global_state()
        ctx.tracker_state = tracker.get_states() if tracker is not None else None
        ctx.tensor_mask = [torch.is_tensor(a) for a in args]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.saved = saved if saved is not None and saved.changes_anything and tensors else None
        if ctx.saved is not None:
            first = tensors[0]
            ctx.first = (first.shape, first.device, first.requires_grad)
            tensors[0] = ctx.saved.pack(first)
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            out = fn(*args)
        ctx.single = torch.is_tensor(out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        kept = list(ctx.saved_tensors)
        requires_grad = [t.requires_grad for t in kept]
        if ctx.saved is not None:
            shape, device, requires_grad[0] = ctx.first
            kept[0] = ctx.saved.unpack(kept[0], shape, device)
        tensors = iter(zip(kept, requires_grad))
        inputs = []
        for is_tensor, other in zip(ctx.tensor_mask, ctx.others):
            if is_tensor:
                t, grad = next(tensors)
                inputs.append(t.detach().requires_grad_(grad))
            else:
                inputs.append(other)
        now_global = _get_global_state()
        now_tracker = ctx.tracker.get_states() if ctx.tracker is not None else None
        _set_global_state(ctx.global_state)
        if ctx.tracker is not None:
            ctx.tracker.set_states(ctx.tracker_state)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _set_global_state(now_global)
            if ctx.tracker is not None:
                ctx.tracker.set_states(now_tracker)
        outs = (out,) if ctx.single else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        tensor_inputs = [i for i in inputs if torch.is_tensor(i)]
        # The recomputed forward belongs to B: inside a zero-bubble B the parameters'
        # gradients go to the weight-gradient store, not to ``.grad``.
        got = iter(weight_grad.backward([o for o, _ in pairs], [g for _, g in pairs],
                                        tensor_inputs) if pairs else [None] * len(tensor_inputs))
        input_grads = tuple(next(got) if torch.is_tensor(i) else None for i in inputs)
        return (None, None, None, *input_grads)


def checkpoint(fn: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None,
               saved: SavedInputLayout | None = None):
    """Activation checkpointing of ``fn(*args)`` that replays CPU/CUDA and tracker randomness.

    ``fn`` returns a tensor or a tuple of tensors. Non-tensor arguments are passed through.
    Like Megatron's (reentrant) checkpoint, gradients reach parameters used inside ``fn`` only
    through ``loss.backward()`` (not ``torch.autograd.grad``), and at least one tensor input
    should require grad. ``saved`` keeps the first tensor input distributed or on the host
    (:mod:`megazero.tensor_parallel.saved_inputs`).
    """
    return _CheckpointFunction.apply(fn, tracker, saved, *args)
