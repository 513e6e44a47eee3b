"""Point-to-point exchange of activations and their grads between neighbouring stages.

One communication step of a schedule (a tuple of ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``
actions) becomes one ``torch.distributed.batch_isend_irecv`` call whose requests are all waited
for before returning, so both neighbours can send and receive at once without either blocking
the other (Megatron's ``send_forward_recv_backward`` and friends).

Why tags: with pp = 2 (and in the interleaved ring) the previous and the next stage are the same
rank, so one step may both send an activation and a grad to it. Activations travel with tag 0
and grads with tag 1; gloo matches messages per (source, tag) in posting order, which makes the
two directions independent FIFO channels, exactly what :mod:`megazero.pipeline.checker` proves
the schedules against. The ops of a step are posted in one fixed order (activation send,
activation receive, grad send, grad receive) so that a backend that ignores tags and matches
per peer in posting order (NCCL) pairs them the same way (the checker proves that too, for
every schedule); NCCL runs a batch as one group, so both directions between the same two ranks
then proceed together.

Shapes are not sent: every tensor has the shape the config implies, ``(seq_length / tp if
sequence parallel else seq_length, micro_batch_size, hidden_size)``, and the dtype given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.schedules import POST_ORDER, Action, Step

TAG_ACTIVATION = 0
TAG_GRAD = 1

Key = tuple[int, int]  # (chunk, microbatch)


def tensor_shape(
    seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int = 1,
    sequence_parallel: bool = False,
) -> tuple[int, int, int]:
    """The shape of a pipeline message: ``[s (/tp with sequence parallelism), b, h]``."""
    if sequence_parallel:
        if seq_length % tp_size:
            raise ValueError(f"seq_length {seq_length} not divisible by tp {tp_size} with "
                             f"sequence parallelism")
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


@dataclass
class P2P:
    """Runs communication steps for one pipeline rank. ``peer`` in actions is a pipeline rank;
    it is mapped to the global rank with the same data- and tensor-parallel coordinates."""

    topo: ParallelTopology
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def global_rank(self, pp_rank: int) -> int:
        c = self.topo.coord
        return self.topo.layout.rank(pp_rank, c.dp, c.tp, self.topo.cp_rank)

    def exchange(
        self, step: Step, outgoing: dict[tuple[str, int, int], torch.Tensor]
    ) -> dict[tuple[str, int, int], torch.Tensor]:
        """Post every action of ``step`` at once and wait for all of them.

        ``outgoing[(kind, chunk, mb)]`` holds the tensor of each send; the result maps
        ``(kind, chunk, mb)`` of each receive to a freshly allocated, received tensor.
        """
        ops: list[dist.P2POp] = []
        received: dict[tuple[str, int, int], torch.Tensor] = {}
        for a in sorted(step, key=lambda a: POST_ORDER[a.kind]):
            ops.append(self._op(a, outgoing, received))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return received

    def _op(self, a: Action, outgoing, received) -> dist.P2POp:
        assert a.peer is not None
        tag = TAG_ACTIVATION if a.kind.endswith("F") else TAG_GRAD
        peer = self.global_rank(a.peer)
        key = (a.kind, a.chunk, a.microbatch)
        if a.kind.startswith("SEND"):
            t = outgoing[key]
            if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
                raise RuntimeError(
                    f"pipeline {a}: tensor {tuple(t.shape)} {t.dtype} does not have the "
                    f"configured message shape {tuple(self.shape)} {self.dtype}")
            return dist.P2POp(dist.isend, t.contiguous(), peer, tag=tag)
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        received[key] = buf
        return dist.P2POp(dist.irecv, buf, peer, tag=tag)
