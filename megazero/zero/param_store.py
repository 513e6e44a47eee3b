"""What the ZeRO engine asks of the container that owns one model chunk's parameters and
gradients (:class:`ParamStore`): :class:`megazero.zero.buffers.GradBuffer` (stages 0-2, flat
bucketed buffers) or :class:`megazero.zero.stage3.Stage3Params` (stage 3, sharded parameters).

Structural (``typing.Protocol``): an object with these methods is one, with no base class to
inherit.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from megazero.zero.pieces import Piece


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
