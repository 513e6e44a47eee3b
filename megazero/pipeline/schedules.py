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
* :func:`interleaved_one_f_one_b` (vpp > 1): Megatron's interleaved order. Micro-batches go
  through the chunks in groups of ``pp``, so the number of micro-batches must be a multiple of
  ``pp`` (classic Megatron). Other counts are rejected with the valid ones: the checker shows
  that the obvious generalisations deadlock when a send blocks until its receive is posted
  (a group larger than ``pp`` overfills the ring of virtual stages; a smaller last group breaks
  the warm-up/steady-state pairing), so they are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config import ConfigError

COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
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


def virtual_stage(pp_rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + pp_rank


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


def interleaved_order(pp: int, vpp: int, num_microbatches: int) -> list[tuple[int, int]]:
    """The forward order of (microbatch, chunk) pairs, the same on every rank.

    Micro-batches go ``pp`` at a time through all chunks: chunk 0 for mb 0..pp-1, then chunk 1
    for the same micro-batches, ..., then the next group. The backward order is the same list
    with chunk ``c`` replaced by ``vpp - 1 - c``.
    """
    return [(start + i, c) for start in range(0, num_microbatches, pp)
            for c in range(vpp) for i in range(pp)]


def interleaved_valid_counts(pp: int, up_to: int = 4) -> list[int]:
    """Micro-batch counts the interleaved schedule accepts: the multiples of ``pp``."""
    return [pp * k for k in range(1, up_to + 1)]


def interleaved_one_f_one_b(
    pp: int, vpp: int, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> list[Step]:
    """Megatron's interleaved 1F1B: ``vpp`` model chunks per rank, smaller pipeline bubble.

    Warm-up runs ``2 (pp - rank - 1) + (vpp - 1) pp`` chunk-forwards (all of them when
    ``m == pp``); steady state does one chunk-forward and one chunk-backward then a single
    batched exchange of up to four tensors; cool-down drains the backwards.
    """
    _check_counts(pp, vpp, num_microbatches, pp_rank)
    if num_microbatches % pp != 0:
        valid = ", ".join(map(str, interleaved_valid_counts(pp)))
        raise ConfigError(
            f"the interleaved pipeline schedule (pp={pp}, vpp={vpp}) needs the number of "
            f"micro-batches to be a multiple of pp={pp}, got num_microbatches="
            f"{num_microbatches}; valid: {valid}, ... (set --global-batch-size to a multiple of "
            f"micro-batch-size x data-parallel-size x {pp}), or drop "
            f"--num-layers-per-virtual-pipeline-stage to use 1F1B, which accepts any count"
        )
    lay = _Layout(pp, vpp, pp_rank)
    order = interleaved_order(pp, vpp, num_microbatches)
    fwd = order
    bwd = [(mb, vpp - 1 - c) for mb, c in order]
    total = len(order)
    if forward_only or num_microbatches == pp:  # one group: nothing to overlap, all warm-up
        warmup = total
    else:
        warmup = min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp, total)
    remaining = total - warmup

    def rf(k: int) -> list[Action]:
        return lay.recv_f(fwd[k][1], fwd[k][0]) if k < total else []

    def sf(k: int) -> list[Action]:
        return lay.send_f(fwd[k][1], fwd[k][0])

    def rb(k: int) -> list[Action]:
        return lay.recv_b(bwd[k][1], bwd[k][0]) if k < total else []

    def sb(k: int) -> list[Action]:
        return lay.send_b(bwd[k][1], bwd[k][0])

    steps: list[Step] = []
    _append_comm(steps, rf(0))
    for k in range(warmup):
        mb, c = fwd[k]
        steps.append((Action("F", c, mb),))
        # The last warm-up exchange also posts the receive of the first backward's grad, so the
        # steady state starts with it already in hand (Megatron does the same).
        first_grad = rb(0) if (k == warmup - 1 and not forward_only) else []
        _append_comm(steps, sf(k) + rf(k + 1) + first_grad)
    for i in range(remaining):
        k = warmup + i
        mb, c = fwd[k]
        steps.append((Action("F", c, mb),))
        bmb, bc = bwd[i]
        steps.append((Action("B", bc, bmb),))
        _append_comm(steps, sf(k) + sb(i) + rf(k + 1) + rb(i + 1))
    if not forward_only:
        for k in range(remaining, total):
            mb, c = bwd[k]
            steps.append((Action("B", c, mb),))
            _append_comm(steps, sb(k) + rb(k + 1))
    return steps


def build_schedule(
    pp: int, vpp: int | None, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> list[Step]:
    """The steps of one pipeline rank: picks the schedule from (pp, vpp)."""
    vpp = vpp or 1
    if pp == 1:
        if vpp != 1:
            raise ConfigError(f"vpp={vpp} needs pp > 1; with pp=1 use vpp=None or 1")
        return no_pipelining(num_microbatches, forward_only)
    if vpp == 1:
        return one_f_one_b(pp, num_microbatches, pp_rank, forward_only)
    return interleaved_one_f_one_b(pp, vpp, num_microbatches, pp_rank, forward_only)


def build_all(
    pp: int, vpp: int | None, num_microbatches: int, forward_only: bool = False
) -> list[list[Step]]:
    """Every rank's schedule, indexed by pipeline rank."""
    return [build_schedule(pp, vpp, num_microbatches, r, forward_only) for r in range(pp)]
