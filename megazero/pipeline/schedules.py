"""Pipeline schedules as data: for each pipeline rank, the ordered list of steps it runs.

A schedule is a list of *steps*; a step is a tuple of :class:`Action`. A compute step holds one
``F`` (forward) or ``B`` (backward) action. A communication step holds one to four ``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B`` actions that are posted together (one
``batch_isend_irecv``) and all waited for before the rank moves on, exactly like Megatron's
``send_forward_recv_backward`` and friends. Nothing here touches a process or a tensor, so
:mod:`megazero.pipeline.checker` can prove a schedule correct, and ``tools/schedule_grid.py``
can print it, without running anything.

Chunks and virtual stages follow Megatron's round-robin layout: model chunk ``c`` of pipeline
rank ``p`` is virtual stage ``c * pp + p``. Activations flow from virtual stage ``v`` to
``v + 1``, so the last rank's chunk ``c`` feeds the first rank's chunk ``c + 1`` (a ring).

Schedules:

* :func:`no_pipelining` (pp = 1): forward and backward of each micro-batch in turn (gradient
  accumulation).
* :func:`one_f_one_b` (vpp = 1): ``pp - rank - 1`` warm-up forwards, then one forward / one
  backward in steady state, then the remaining backwards. At most ``pp - rank`` micro-batches
  are in flight on a rank, whatever the number of micro-batches.
* :func:`interleaved_one_f_one_b` (vpp > 1): megatron-core's interleaved order.
  Micro-batches go through the chunks in groups of N
  (``--microbatch-group-size-per-virtual-pipeline-stage``, ``pp <= N <= M``, default pp); any
  number of micro-batches M >= pp runs whose last group (``M mod N``) is empty or at least pp
  (:func:`megazero.config.check_microbatch_groups` owns that rule). Others are refused with
  the group sizes that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config import ConfigError, check_microbatch_groups
from megazero.config.rules import check_vpp_needs_pp

#: ``W`` is the weight-gradient half of a split backward (zero-bubble schedules): a rank whose
#: schedule has a W for a (chunk, micro-batch) runs that micro-batch's B as input gradient only.
COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# The order in which the executor posts the actions of one communication step (see
# megazero.pipeline.p2p); the checker proves message matching in this order too.
POST_ORDER = {kind: i for i, kind in enumerate(COMM_KINDS)}
_SHORT = {"SEND_F": "sF", "RECV_F": "rF", "SEND_B": "sB", "RECV_B": "rB"}


@dataclass(frozen=True)
class Action:
    """One thing a rank does. ``chunk`` is the rank's local model chunk; ``peer`` is the pipeline
    rank (stage index, not a global rank) a communication goes to or comes from."""

    kind: str
    chunk: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind}{self.microbatch}.{self.chunk}"
        arrow = ">" if self.kind.startswith("SEND") else "<"
        return f"{_SHORT[self.kind]}{self.microbatch}.{self.chunk}{arrow}{self.peer}"


Step = tuple[Action, ...]


#: Where chunks sit: ``loop`` is Megatron's round-robin (chunk ``c`` of rank ``r`` is virtual
#: stage ``c * pp + r``); ``v`` is the V of ZBV and DualPipeV, two chunks per rank, chunk 0 at
#: stage ``r`` and chunk 1 at stage ``2 pp - 1 - r``: the last rank feeds itself, and the
#: first and last stages (embedding, loss) are both on rank 0.
PLACEMENTS = ("loop", "v")


def virtual_stage(pp_rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    if placement == "v":
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_owner(vstage: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """``(pp_rank, chunk)`` holding virtual stage ``vstage``."""
    if placement == "v":
        return (vstage, 0) if vstage < pp else (2 * pp - 1 - vstage, 1)
    return vstage % pp, vstage // pp


@dataclass(frozen=True)
class _Layout:
    """Neighbour arithmetic for one rank of a (pp, vpp) ring of virtual stages."""

    pp: int
    vpp: int
    rank: int

    def vstage(self, chunk: int) -> int:
        return virtual_stage(self.rank, chunk, self.pp)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.pp

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.pp

    def is_first(self, chunk: int) -> bool:
        return self.vstage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.vstage(chunk) == self.pp * self.vpp - 1

    def send_f(self, chunk: int, mb: int) -> list[Action]:
        return [] if self.is_last(chunk) else [Action("SEND_F", chunk, mb, self.next_rank)]

    def recv_f(self, chunk: int, mb: int) -> list[Action]:
        return [] if self.is_first(chunk) else [Action("RECV_F", chunk, mb, self.prev_rank)]

    def send_b(self, chunk: int, mb: int) -> list[Action]:
        return [] if self.is_first(chunk) else [Action("SEND_B", chunk, mb, self.prev_rank)]

    def recv_b(self, chunk: int, mb: int) -> list[Action]:
        return [] if self.is_last(chunk) else [Action("RECV_B", chunk, mb, self.next_rank)]


def _append_comm(steps: list[Step], actions: list[Action]) -> None:
    if actions:
        steps.append(tuple(actions))


def _check_counts(pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> None:
    for name, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= pp_rank < pp:
        raise ConfigError(f"pp_rank {pp_rank} outside 0..{pp - 1}")


def no_pipelining(num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """pp = 1: every micro-batch's forward then its backward (gradient accumulation)."""
    _check_counts(1, 1, num_microbatches, 0)
    steps: list[Step] = []
    for mb in range(num_microbatches):
        steps.append((Action("F", 0, mb),))
        if not forward_only:
            steps.append((Action("B", 0, mb),))
    return steps


def one_f_one_b(
    pp: int, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> list[Step]:
    """Non-interleaved 1F1B (PipeDream-Flush), with Megatron's batched send/recv pairs."""
    _check_counts(pp, 1, num_microbatches, pp_rank)
    lay, m = _Layout(pp, 1, pp_rank), num_microbatches
    steps: list[Step] = []
    if forward_only:
        for mb in range(m):
            _append_comm(steps, lay.recv_f(0, mb))
            steps.append((Action("F", 0, mb),))
            _append_comm(steps, lay.send_f(0, mb))
        return steps
    warmup = min(pp - pp_rank - 1, m)
    remaining = m - warmup
    for mb in range(warmup):
        _append_comm(steps, lay.recv_f(0, mb))
        steps.append((Action("F", 0, mb),))
        _append_comm(steps, lay.send_f(0, mb))
    if remaining:
        _append_comm(steps, lay.recv_f(0, warmup))
    for i in range(remaining):
        fwd = warmup + i
        steps.append((Action("F", 0, fwd),))
        # Send this forward's output and wait for the oldest micro-batch's output grad at once:
        # the next stage does the mirror-image pair, so neither side blocks the other.
        _append_comm(steps, lay.send_f(0, fwd) + lay.recv_b(0, i))
        steps.append((Action("B", 0, i),))
        if i == remaining - 1:
            _append_comm(steps, lay.send_b(0, i))
        else:
            _append_comm(steps, lay.send_b(0, i) + lay.recv_f(0, fwd + 1))
    for mb in range(remaining, m):
        _append_comm(steps, lay.recv_b(0, mb))
        steps.append((Action("B", 0, mb),))
        _append_comm(steps, lay.send_b(0, mb))
    return steps


def interleaved_order(
    pp: int, vpp: int, num_microbatches: int, group_size: int | None = None
) -> list[tuple[int, int]]:
    """The forward order of (microbatch, chunk) pairs, the same on every rank.

    Micro-batches go ``group_size`` (N, default ``pp``) at a time through all chunks: chunk 0
    for mb 0..N-1, then chunk 1 for the same micro-batches, ..., then the next group; the last
    group takes whatever is left (Megatron-core's ``get_schedule_table``). The backward order is
    the same list with chunk ``c`` replaced by ``vpp - 1 - c``.
    """
    n = group_size or pp
    order: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, n):
        group = range(start, min(start + n, num_microbatches))
        order += [(mb, c) for c in range(vpp) for mb in group]
    return order


def interleaved_warmup(pp: int, vpp: int, num_microbatches: int, pp_rank: int,
                       group_size: int | None = None) -> int:
    """Chunk-forwards rank ``pp_rank`` runs before its first backward (megatron-core's count):
    ``2 (pp - rank - 1) + (vpp - 1) N``, or all ``vpp M`` of them when that is not fewer."""
    n = group_size or pp
    return min(2 * (pp - pp_rank - 1) + (vpp - 1) * n, vpp * num_microbatches)


def interleaved_one_f_one_b(
    pp: int, vpp: int, num_microbatches: int, pp_rank: int, forward_only: bool = False,
    group_size: int | None = None, extra_warmup: int = 0,
) -> list[Step]:
    """Interleaved 1F1B: ``vpp`` model chunks per rank, micro-batches in groups of N
    (``extra_warmup``: that many more chunk-forwards before the first backward, see
    :func:`build_schedule`).

    Order: :func:`interleaved_order` for forwards (backwards mirror the chunks);
    :func:`interleaved_warmup` chunk-forwards first, then one forward and one backward followed
    by a single batched exchange of up to four tensors, then the remaining backwards.

    Compared with megatron-core 0.16 (``forward_backward_pipelining_with_interleaving``) for the
    same (pp, vpp, M, N): the compute order, warm-up counts included, is the same on every rank.
    The communication is that of its ``batch_p2p_comm`` path (the library default: each
    iteration's sends and receives in one batch, all waited for). Megatron-LM's training script
    defaults to ``overlap_p2p_comm`` instead, which posts the same messages as separate
    asynchronous sends and receives and waits for each just before its tensor is used; the
    executor blocks on every exchange, so that variant is not reproduced. Older Megatron
    (megatron-core up to 0.9) differs for ``M == pp``: every rank ran all ``vpp pp``
    chunk-forwards as warm-up; the formula used here (and by megatron-core since the group
    size exists) gives later ranks fewer, so the last rank holds ``(vpp - 1) pp + 1``
    chunk-micro-batches instead of ``vpp pp``, with the same bubble.

    Who receives what, and when. A rank that is not the *leading* one for a direction (rank 0
    for activations, rank ``pp - 1`` for grads) receives, in the exchange after computing item
    ``k``, the input of item ``k + 1``. The leading rank's input for chunk ``c + 1`` comes round
    the ring from the last rank's chunk ``c``; the leading rank runs ``pp - 1`` items ahead of
    it, so it receives, after item ``k``, what the other end produced at item ``k - (pp - 1)``,
    and keeps it until its turn comes (up to ``N - pp + 1`` of them at once: the receive
    buffers the checker counts). With ``N == pp`` that is again the next item's input. Posting
    the leading rank's receive just before its turn instead makes the last rank's send wait
    ``N - pp`` items for it (the checker finds a longer makespan), and once the stalled sends
    back up the whole ring (``N >= 2 pp`` or so) nobody can move: a deadlock. The last group
    must be empty or at least pp long for the same alignment: the last rank's final sends round
    the ring come at least ``pp - 1`` items before the end.
    """
    _check_counts(pp, vpp, num_microbatches, pp_rank)
    n = check_microbatch_groups(pp, num_microbatches, group_size)
    lay = _Layout(pp, vpp, pp_rank)
    fwd = interleaved_order(pp, vpp, num_microbatches, n)
    bwd = [(mb, vpp - 1 - c) for mb, c in fwd]
    total = len(fwd)
    warmup = total if forward_only else min(
        interleaved_warmup(pp, vpp, num_microbatches, pp_rank, n) + extra_warmup, total)
    remaining = total - warmup

    def sf(k: int) -> list[Action]:
        return lay.send_f(fwd[k][1], fwd[k][0])

    def sb(k: int) -> list[Action]:
        return lay.send_b(bwd[k][1], bwd[k][0])

    def rf_after(k: int) -> list[Action]:
        """The activation received in the exchange after forward ``k``."""
        if pp_rank == 0:
            j = k - (pp - 1)
            if j < 0 or fwd[j][1] == vpp - 1:
                return []
            return lay.recv_f(fwd[j][1] + 1, fwd[j][0])
        return lay.recv_f(fwd[k + 1][1], fwd[k + 1][0]) if k + 1 < total else []

    def rb_after(k: int) -> list[Action]:
        """The grad received in the exchange after backward ``k`` (``k = -1``: before the
        first backward)."""
        if pp_rank == pp - 1:
            j = k - (pp - 1)
            if j < 0 or bwd[j][1] == 0:
                return []
            return lay.recv_b(bwd[j][1] - 1, bwd[j][0])
        return lay.recv_b(bwd[k + 1][1], bwd[k + 1][0]) if k + 1 < total else []

    steps: list[Step] = []
    _append_comm(steps, lay.recv_f(fwd[0][1], fwd[0][0]))
    for k in range(warmup):
        mb, c = fwd[k]
        steps.append((Action("F", c, mb),))
        # The last warm-up exchange also posts the receive of the first backward's grad, so the
        # steady state starts with it already in hand (Megatron does the same).
        first_grad = rb_after(-1) if (k == warmup - 1 and remaining) else []
        _append_comm(steps, sf(k) + rf_after(k) + first_grad)
    if not forward_only and not remaining:
        _append_comm(steps, rb_after(-1))
    for i in range(remaining):
        k = warmup + i
        mb, c = fwd[k]
        steps.append((Action("F", c, mb),))
        bmb, bc = bwd[i]
        steps.append((Action("B", bc, bmb),))
        _append_comm(steps, sf(k) + sb(i) + rf_after(k) + rb_after(i))
    if not forward_only:
        for k in range(remaining, total):
            mb, c = bwd[k]
            steps.append((Action("B", c, mb),))
            _append_comm(steps, sb(k) + rb_after(k))
    return steps


def build_schedule(
    pp: int, vpp: int | None, num_microbatches: int, pp_rank: int, forward_only: bool = False,
    group_size: int | None = None, extra_warmup: int = 0,
) -> list[Step]:
    """The steps of one pipeline rank: picks the schedule from (pp, vpp). ``group_size`` is
    the interleaved schedule's micro-batch group size N (default pp); 1F1B ignores it.
    ``extra_warmup``: chunk-forwards the interleaved schedule runs before its first backward
    beyond megatron-core's count (one under the combined 1F1B, as megatron-core's)."""
    vpp = vpp or 1
    check_vpp_needs_pp(pp, vpp)
    if pp == 1:
        return no_pipelining(num_microbatches, forward_only)
    if vpp == 1:
        return one_f_one_b(pp, num_microbatches, pp_rank, forward_only)
    return interleaved_one_f_one_b(pp, vpp, num_microbatches, pp_rank, forward_only, group_size,
                                   extra_warmup)


def build_all(
    pp: int, vpp: int | None, num_microbatches: int, forward_only: bool = False,
    group_size: int | None = None,
) -> list[list[Step]]:
    """Every rank's schedule, indexed by pipeline rank."""
    return [build_schedule(pp, vpp, num_microbatches, r, forward_only, group_size)
            for r in range(pp)]
