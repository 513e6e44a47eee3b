"""What the pipeline executor and the training loop ask of a data-parallel engine
(:class:`GradSync`): suspend gradient reduction for all micro-batches but the last, launch the
reduction of what is still waiting once a chunk's backwards are done, and complete it (the
data-parallel reduction plus the sequence-parallel sums over tensor-parallel ranks and the
tied-embedding sums over the embedding group).

:class:`megazero.zero.ZeroOptimizer` is the one implementation in the library, at every ZeRO
stage; a run without ZeRO is a stage-0 engine (plain all-reduce), so there is one gradient-sync
path for training and for the equivalence tests. The protocol is structural: an object with
these methods is one, with no base class to inherit, and this module imports nothing else of
the package, so the pipeline never depends on the engine.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol


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
