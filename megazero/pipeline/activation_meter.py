"""What a pipeline iteration keeps alive for backward, measured while it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ActivationMeter:
    """Counts what forwards leave behind for their backwards, per (chunk, micro-batch).

    ``inflight`` counts chunk-micro-batches whose forward ran and whose backward has not;
    ``saved_bytes`` adds up the storages of the tensors autograd saved during each forward
    (parameters excluded), taken with ``saved_tensors_hooks``, and drops them when that
    backward finishes. A storage counts once per forward however many saved views share it
    (attention saves its output and the projection saves the same storage as its input; the
    slices Q, K, V of one fused projection output are one storage), so the count is the bytes
    the forward keeps alive, not the sum of the saved views.

    Pass one to :func:`megazero.pipeline.executor.forward_backward` as ``activation_meter``;
    afterwards it holds that iteration's ``peak_inflight``, ``peak_saved_bytes``,
    ``saved_bytes_per_forward`` (one entry per forward, in schedule order) and
    ``peak_output_elements`` (elements of kept forward outputs; deallocated ones hold one).
    ``--log-memory-phases`` and the planner's measured validation read ``peak_saved_bytes``.
    """

    def __init__(self) -> None:
        self.start([])

    def start(self, params: list[torch.nn.Parameter]) -> None:
        """Begin an iteration: forget the last one; ``params`` are state, never counted."""
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[tuple[int, int], int] = {}
        self._storages: set[int] = set()
        self.peak_inflight = 0
        self.peak_saved_bytes = 0
        self.saved_bytes_per_forward: list[int] = []
        self.peak_output_elements = 0
        self._current: tuple[int, int] | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is None:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_ptrs and ptr not in self._storages:
            self._storages.add(ptr)
            self.live[self._current] += storage.nbytes()
        return t

    @contextlib.contextmanager
    def forward(self, key: tuple[int, int]) -> Iterator[None]:
        self.live[key] = 0
        self._current = key
        self._storages = set()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield
        self._current = None
        self.saved_bytes_per_forward.append(self.live[key])
        self.peak_inflight = max(self.peak_inflight, len(self.live))
        self.peak_saved_bytes = max(self.peak_saved_bytes, sum(self.live.values()))

    def backward_done(self, key: tuple[int, int]) -> None:
        self.live.pop(key, None)

    def held_outputs(self, outputs: dict[tuple[int, int], torch.Tensor]) -> None:
        """Elements still stored in kept forward outputs (deallocated ones hold one)."""
        held = sum(o.numel() for o in outputs.values())
        self.peak_output_elements = max(self.peak_output_elements, held)
