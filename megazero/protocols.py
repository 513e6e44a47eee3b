"""The typed seams between the pipeline executor, the training loop and the ZeRO engine.

:class:`GradSync` is what the pipeline executor and the training loop ask of a data-parallel
engine: suspend gradient reduction for all micro-batches but the last, launch the reduction of
what is still waiting once a chunk's backwards are done, and complete it (the data-parallel
reduction plus the sequence-parallel sums over tensor-parallel ranks and the tied-embedding sums
over the embedding group). :class:`megazero.zero.ZeroOptimizer` is the one implementation in
the library, at every ZeRO stage; a run without ZeRO is a stage-0 engine (plain all-reduce), so
there is one gradient-sync path for training and for the equivalence tests.

:class:`ParamStore` is what the ZeRO engine asks of the container that owns one model chunk's
parameters and gradients: :class:`megazero.zero.buffers.GradBuffer` (stages 0-2, flat bucketed
buffers) or :class:`megazero.zero.stage3.Stage3Params` (stage 3, sharded parameters).

Both are structural (``typing.Protocol``): an object with these methods is one, with no base
class to inherit. This module imports nothing from the rest of the package at run time, so any
module can name these types.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from megazero.zero.master import Piece


class GradSync(Protocol):
    """Gradient synchronisation around one iteration's backwards (see the module docstring).

    Order on every rank: every backward but each chunk's last micro-batch inside
    ``no_sync()``; ``start_grad_sync()`` after a chunk's last backward (or once after all of
    them); ``finish_grad_sync()`` before reading the gradients or stepping the optimizer.
    """

    def no_sync(self) -> AbstractContextManager[None]:
        """A context for the backwards of an iteration's earlier micro-batches: gradients
        accumulate locally where the implementation defers the reduction (ZeRO 0-1), or are
        reduced into their shards at once where it partitions them (ZeRO 2-3)."""
        ...

    def start_grad_sync(self) -> None:
        """Launch the reduction of every gradient still waiting (asynchronous where it can)."""
        ...

    def finish_grad_sync(self) -> None:
        """Complete this step's reductions; afterwards the gradients are the global ones."""
        ...


class ParamStore(Protocol):
    """One chunk's parameters and gradients as the ZeRO engine drives them.

    Gradient life cycle per step: ``grad_ready`` / ``grad_accumulated`` from the parameters'
    post-accumulate hooks, then ``flush``, ``wait``, ``absorb_deferred``, the engine's sums over
    ``deferred_grads(kind)`` (``"sp"``: tensor-parallel group, ``"emb"``: embedding group), and
    ``reduce_deferred``; ``zero_grad`` starts the next step.
    """

    padding: int  # elements added to align buckets or units to the data-parallel size

    def params(self) -> list[nn.Parameter]: ...

    def pieces(self) -> list[Piece]:
        """This rank's owned ranges of each parameter, for the fp32 masters."""
        ...

    def zero_grad(self) -> None: ...

    def grad_ready(self, param: nn.Parameter) -> None: ...

    def grad_accumulated(self, param: nn.Parameter) -> None: ...

    def flush(self) -> None: ...

    def wait(self) -> None: ...

    def absorb_deferred(self) -> None: ...

    def deferred_grads(self, kind: str) -> list[torch.Tensor]: ...

    def reduce_deferred(self) -> None: ...

    def unused_params(self) -> list[nn.Parameter]: ...

    def after_step(self, chunk: int | None, use_broadcast: bool) -> None:
        """Refresh the full parameters every rank holds from the updated shards."""
        ...

    def held_params(self) -> dict[str, list[torch.Tensor]]: ...

    def param_shapes(self) -> dict[int, torch.Size]:
        """Each parameter's shape keyed by ``id(param)``, also while stage 3 has released it."""
        ...

    def held_grads(self) -> list[torch.Tensor]: ...

    def gather_all(self) -> None:
        """Make every parameter hold its full value (a no-op where they always do)."""
        ...

    def release_all(self, write_back: bool = False) -> None:
        """Undo :meth:`gather_all`; ``write_back`` keeps values assigned in between."""
        ...

    def gathered_state(self) -> dict[int, torch.Tensor]:
        """A full copy of every parameter keyed by ``id(param)`` (collective at stage 3)."""
        ...
