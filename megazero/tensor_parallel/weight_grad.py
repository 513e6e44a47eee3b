"""The backward split in two: B (the input gradient, which the previous stage waits for) and W
(the weight gradients, which nothing downstream waits for), as zero-bubble pipeline schedules
need (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Outside :func:`deferring` nothing changes: every layer computes its weight gradient in its
backward, as autograd always does. Inside it, a backward runs as B:

* the GEMM layers (column- and row-parallel linears, the output layer, the experts' linears and
  grouped GEMMs) hand their weight-gradient GEMM to :func:`run_or_defer` as a closure over what
  it needs (the saved input and the output gradient); the store keeps the closure and the
  layer returns no weight gradient;
* every other parameter (norms, biases, embeddings, routers: cheap reductions) gets its
  gradient computed in B by :func:`backward`, which asks autograd for the parameters' gradients
  instead of accumulating them, and the store keeps them too.

:meth:`WeightGradStore.run` is W: it runs the closures and accumulates every gradient the store
holds into ``param.grad`` exactly as autograd's ``AccumulateGrad`` does, then calls the
parameter's post-accumulate hooks. So the fp32 main-grad buffers, the expert-gradient scaling
and the ZeRO bucket hooks see a parameter's gradient once, complete, after its W, and never in
B. Tensor pre-hooks (``param.register_hook``) run once per contribution as in a normal
backward: autograd already applied them to the gradients computed in B; W applies them to the
closures' results.

Why a store per (chunk, micro-batch) rather than one queue: the schedules run W of a
micro-batch long after its B, with other micro-batches' B in between, and the W of each must
accumulate only its own gradients (Megatron's single FIFO ``WeightGradStore`` only works for
its fixed delay of one slot).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.autograd import Variable

WeightGradFn = Callable[[], torch.Tensor]
GroupWeightGradFn = Callable[[], Sequence[torch.Tensor]]

_active: list[WeightGradStore] = []


class WeightGradStore:
    """The deferred weight-gradient work of one (chunk, micro-batch): closures and the
    gradients already computed in B, per parameter, until :meth:`run`."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._closures: list[tuple[Sequence[torch.Tensor], GroupWeightGradFn]] = []
        self._computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._closures) + len(self._computed)

    def defer(self, params: Sequence[torch.Tensor], fn: GroupWeightGradFn) -> None:
        """Keep ``fn`` for W; it returns one gradient per parameter of ``params``."""
        self._closures.append((params, fn))

    def add_computed(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient computed in B (tensor pre-hooks already applied)."""
        old = self._computed.get(id(param))
        self._computed[id(param)] = (param, grad if old is None else old[1] + grad)

    def stash_bytes(self) -> int:
        """Bytes held for W: computed gradients (the closures' saved tensors are the
        activations' and are counted with them)."""
        return sum(g.numel() * g.element_size() for _, g in self._computed.values())

    @torch.no_grad()
    def run(self) -> None:
        """W: compute the deferred weight gradients, accumulate, fire the post-accumulate
        hooks once per parameter."""
        closures, computed = self._closures, self._computed
        self._closures, self._computed = [], {}
        totals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for params, fn in closures:
            for param, grad in zip(params, fn(), strict=True):
                g = _pre_hooks(param, grad)
                old = totals.get(id(param))
                totals[id(param)] = (param, g if old is None else old[1] + g)
        for key, (param, g) in computed.items():
            old = totals.get(key)
            totals[key] = (param, g if old is None else old[1] + g)
        for param, g in totals.values():
            _accumulate(param, g)
        for param, _ in totals.values():
            hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            for hook in list((hooks or {}).values()):
                hook(param)


def _pre_hooks(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    for hook in list((param._backward_hooks or {}).values()):
        out = hook(grad)
        grad = grad if out is None else out
    return grad


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``AccumulateGrad``: the first gradient becomes ``param.grad``, later ones are added in
    place (a ``param.grad`` that is a view into a bucket stays that view)."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.contiguous() if grad.shape == param.shape else grad.reshape(
            param.shape)
    else:
        param.grad.add_(grad.view_as(param.grad))


def current() -> WeightGradStore | None:
    """The store that backwards now defer into, if any."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def deferring(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """Backwards inside are B: weight gradients go to ``store`` (see the module docstring)."""
    _active.append(store)
    try:
        yield store
    finally:
        _active.pop()


def run_or_defer(param: torch.Tensor, fn: WeightGradFn) -> torch.Tensor | None:
    """The weight gradient ``fn()`` now, or ``None`` with ``fn`` kept for W when a store is
    active and ``param`` is a leaf (a weight computed from others, such as the grouped GEMM's
    stacked experts, gets its gradient now: the graph behind it needs it)."""
    store = current()
    if store is None or not (param.is_leaf and param.requires_grad):
        return fn()
    store.defer((param,), lambda: (fn(),))
    return None


def run_or_defer_group(params: Sequence[torch.Tensor], fn: GroupWeightGradFn
                       ) -> Sequence[torch.Tensor] | None:
    """:func:`run_or_defer` for weights whose gradients one computation gives together (the
    experts of a grouped GEMM): ``fn()`` returns one gradient per parameter."""
    store = current()
    if store is None or not all(p.is_leaf and p.requires_grad for p in params):
        return fn()
    store.defer(tuple(params), fn)
    return None


def backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
             inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``torch.autograd.backward(outputs, grads)``, returning the gradients of ``inputs``; inside
    :func:`deferring` the active store's parameters get theirs into the store instead of
    ``.grad``. Skips autograd's shape check of ``grads`` against ``outputs`` (an output freed
    after it was sent keeps only its graph, see ``pipeline.executor.deallocate_output_tensor``).
    """
    store = current()
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    wanted = [t for t in inputs if t.requires_grad]
    if store is None:
        Variable._execution_engine.run_backward(
            tuple(outputs), tuple(grads), False, False, (), True, True)
        return [t.grad if t.requires_grad else None for t in inputs]
    params = [p for p in store.params if all(p is not t for t in wanted)]
    with _none_safe_pre_hooks(params):
        got = Variable._execution_engine.run_backward(
            tuple(outputs), tuple(grads), False, False, tuple(wanted + params), True, False)
    for p, g in zip(params, got[len(wanted):]):
        if g is not None:
            store.add_computed(p, g)
    by_id = {id(t): g for t, g in zip(wanted, got[:len(wanted)])}
    return [by_id.get(id(t)) for t in inputs]


@contextlib.contextmanager
def _none_safe_pre_hooks(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Asked for a parameter's gradient, autograd calls its tensor pre-hooks even when the
    gradient is undefined (a layer left it to W); let those calls pass."""
    saved: list[tuple[dict, object, Callable]] = []
    for p in params:
        hooks = p._backward_hooks
        for key, hook in list((hooks or {}).items()):
            saved.append((hooks, key, hook))
            hooks[key] = _skip_none(hook)
    try:
        yield
    finally:
        for hooks, key, hook in saved:
            hooks[key] = hook


def _skip_none(hook: Callable) -> Callable:
    def safe(grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if grad is None else hook(grad)

    return safe
