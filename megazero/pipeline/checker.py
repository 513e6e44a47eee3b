"""Prove a pipeline schedule correct by simulating every rank, without processes.

:func:`check_schedules` takes all ranks' step lists (see :mod:`megazero.pipeline.schedules`)
and verifies, raising :class:`ScheduleError` with a readable reason otherwise:

1. **Work**: each rank runs the forward and the backward of every (chunk, micro-batch) exactly
   once (forwards only in forward-only mode), each backward after its forward; a rank that
   splits its backwards (``W`` actions, zero-bubble schedules) runs every W exactly once, after
   its B.
2. **Local data flow**: a chunk's forward comes after the receive of its input activation,
   a send of an activation after the forward that made it, a backward after the receive of its
   output grad, and the send of an input grad after that backward.
3. **Matching**: messages on each channel (source rank, destination rank, forward or backward
   direction) are matched first-in first-out, as point-to-point messages with one tag are; the
   i-th send and the i-th receive must carry the same slot (direction, producing virtual stage,
   micro-batch), so the receiver gets the tensor it thinks it gets. The same must hold per pair
   of ranks with both directions in one queue, in the executor's posting order
   (:data:`~megazero.pipeline.schedules.POST_ORDER` within a step), so a backend that ignores
   tags (NCCL) pairs the same messages.
4. **No deadlock**, under the communication model of :class:`megazero.pipeline.p2p.P2P`, which
   the executor uses for every communication step: the step's sends and receives are posted
   together (one ``batch_isend_irecv``, as Megatron's ``p2p_communication`` batches
   ``send_forward_backward_recv_forward_backward`` and friends) and all of them are waited for
   before the rank moves on. So a step completes exactly when every one of its messages has
   been posted by the peer (rendezvous: a send is treated as blocking until its receive is
   posted, as gloo does and NCCL may). Ranks are advanced with these semantics; if no rank can
   advance before all are done, the schedule deadlocks and the error lists what each stuck rank
   waits for.
5. **Memory bound** (training schedules, unless ``memory_bound=False``): no rank holds more
   micro-batches in flight than 1F1B's warm-up allows (:func:`inflight_bound`: ``pp - rank``
   without interleaving, megatron-core's ``2(pp - rank - 1) + (vpp - 1)N`` warm-up plus one
   with it, N the micro-batch group size). A schedule with one extra warm-up forward is still
   correct and deadlock-free, but holds one more micro-batch's activations than the memory
   estimates promise.
6. **Receive buffers** (with the memory bound): a received tensor lives in its own buffer from
   the step that posts its receive until the forward or backward that consumes it (the executor
   allocates one per receive and drops it there). No rank may hold more of them per direction
   than :func:`recv_buffer_bound`: one, except on the rank that receives from the other end of
   the ring (rank 0 for activations, the last rank for grads), which takes an input up to
   ``N - pp`` items before its turn and so needs ``N - pp + 1`` (megatron-core's receive ring of
   that size). The count is checked at posting time, so a buffer is never reused while a
   tensor it holds is still waiting for its compute.

The same simulation gives a timeline (forward cost ``f_time``, backward ``b_time``, of which
``w_time`` is the weight-gradient part W when split, communication free), hence each rank's
idle time (the bubble), its peak number of micro-batches in flight (forwards whose backward,
or W when split, has not finished: the activations and W stashes it holds) and its peak
number of W stashes (B done, W not yet). ``placement`` says where the chunks sit
(:data:`~megazero.pipeline.schedules.PLACEMENTS`); in the V the last rank hands its chunk 0's
activation to its chunk 1 without a message, which the checker proves by order instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from megazero.pipeline.schedules import POST_ORDER, Action, Step, stage_owner, virtual_stage


class ScheduleError(RuntimeError):
    """A schedule that is wrong: missing work, unmatched messages, or a deadlock."""


@dataclass(frozen=True)
class Interval:
    rank: int
    start: float
    end: float
    action: Action


@dataclass
class SimResult:
    """What the simulation of a correct schedule found."""

    pp: int
    vpp: int
    num_microbatches: int
    intervals: list[Interval] = field(default_factory=list)
    makespan: float = 0.0
    busy: list[float] = field(default_factory=list)
    peak_inflight: list[int] = field(default_factory=list)  # in chunk-micro-batches
    # most received-but-not-yet-consumed tensors per rank: activations, grads
    peak_recv_buffers: list[tuple[int, int]] = field(default_factory=list)
    peak_w_stash: list[int] = field(default_factory=list)  # B done, W not yet

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> list[float]:
        """Idle time over busy time per rank: Megatron's (p-1)/m is this ratio for 1F1B."""
        return [i / b if b else 0.0 for i, b in zip(self.idle, self.busy)]

    @property
    def peak_inflight_stage_equivalents(self) -> list[float]:
        """Peak in-flight chunk-micro-batches divided by vpp: activations held, in units of one
        micro-batch through a whole (non-interleaved) stage."""
        return [p / self.vpp for p in self.peak_inflight]


def _slot(rank: int, a: Action, pp: int, placement: str = "loop") -> tuple[str, int, int]:
    """What a message carries: direction, the virtual stage that produced it, micro-batch."""
    v = virtual_stage(rank, a.chunk, pp, placement)
    if a.kind == "SEND_F":
        return ("F", v, a.microbatch)
    if a.kind == "RECV_F":
        return ("F", v - 1, a.microbatch)
    if a.kind == "SEND_B":
        return ("B", v, a.microbatch)
    return ("B", v + 1, a.microbatch)


def _channel(rank: int, a: Action) -> tuple[int, int, str]:
    assert a.peer is not None
    direction = a.kind[-1]
    if a.kind.startswith("SEND"):
        return (rank, a.peer, direction)
    return (a.peer, rank, direction)


def _check_work(schedules: list[list[Step]], vpp: int, m: int, forward_only: bool,
                placement: str = "loop") -> None:
    pp = len(schedules)
    for rank, steps in enumerate(schedules):
        seen: dict[tuple[str, int, int], int] = {}
        for i, step in enumerate(steps):
            if not step:
                raise ScheduleError(f"rank {rank} step {i} is empty")
            if any(a.is_compute for a in step) and len(step) != 1:
                raise ScheduleError(f"rank {rank} step {i} mixes compute with other actions")
            for a in step:
                if not (0 <= a.chunk < vpp and 0 <= a.microbatch < m):
                    raise ScheduleError(f"rank {rank} step {i}: {a} out of range")
                if not a.is_compute and not (a.peer is not None and 0 <= a.peer < pp):
                    raise ScheduleError(f"rank {rank} step {i}: {a} has no valid peer")
                key = (a.kind, a.chunk, a.microbatch)
                if key in seen:
                    raise ScheduleError(f"rank {rank}: {a} appears twice (steps {seen[key]}, {i})")
                seen[key] = i
        last_v = pp * vpp - 1
        split = any(k[0] == "W" for k in seen)
        for c in range(vpp):
            v = virtual_stage(rank, c, pp, placement)
            # neighbours on this rank exchange no message: order proves the hand-off
            local_prev = v > 0 and stage_owner(v - 1, pp, placement)[0] == rank
            local_next = v < last_v and stage_owner(v + 1, pp, placement)[0] == rank
            for mb in range(m):
                f, b = seen.get(("F", c, mb)), seen.get(("B", c, mb))
                if f is None:
                    raise ScheduleError(f"rank {rank}: forward F{mb}.{c} never runs")
                if forward_only:
                    if b is not None:
                        raise ScheduleError(f"rank {rank}: backward in a forward-only schedule")
                elif b is None:
                    raise ScheduleError(f"rank {rank}: backward B{mb}.{c} never runs")
                elif b < f:
                    raise ScheduleError(f"rank {rank}: B{mb}.{c} (step {b}) before its forward")
                w = seen.get(("W", c, mb))
                if split and not forward_only and w is None:
                    raise ScheduleError(f"rank {rank}: W{mb}.{c} never runs (its B left the "
                                        f"weight gradients to it)")
                if w is not None and b is not None and w < b:
                    raise ScheduleError(f"rank {rank}: W{mb}.{c} (step {w}) runs before its "
                                        f"backward B{mb}.{c} (step {b})")
                if w is not None and b is None:
                    raise ScheduleError(f"rank {rank}: W{mb}.{c} without its backward")
                _check_order(rank, seen, ("RECV_F", c, mb), ("F", c, mb),
                             v > 0 and not local_prev)
                _check_order(rank, seen, ("F", c, mb), ("SEND_F", c, mb),
                             v < last_v and not local_next)
                if local_next:
                    nc = stage_owner(v + 1, pp, placement)[1]
                    _check_order(rank, seen, ("F", c, mb), ("F", nc, mb), True)
                    if not forward_only:
                        _check_order(rank, seen, ("B", nc, mb), ("B", c, mb), True)
                if not forward_only:
                    _check_order(rank, seen, ("RECV_B", c, mb), ("B", c, mb),
                                 v < last_v and not local_next)
                    _check_order(rank, seen, ("B", c, mb), ("SEND_B", c, mb),
                                 v > 0 and not local_prev)


def _check_order(rank, seen, first, then, required: bool) -> None:
    name = f"{first[0]} {first[2]}.{first[1]}"
    if not required:
        if first[0] in ("RECV_F", "SEND_F", "RECV_B", "SEND_B") and first in seen:
            raise ScheduleError(f"rank {rank}: unexpected {name} (no neighbour needs it)")
        if then[0] in ("SEND_F", "SEND_B") and then in seen:
            raise ScheduleError(f"rank {rank}: unexpected {then[0]} {then[2]}.{then[1]}")
        return
    if first not in seen:
        raise ScheduleError(f"rank {rank}: missing {name} (needed by {then[0]})")
    if then in seen and seen[then] <= seen[first]:
        raise ScheduleError(f"rank {rank}: {then[0]} {then[2]}.{then[1]} runs before {name}")


def _match(schedules: list[list[Step]], placement: str = "loop"
           ) -> dict[tuple[int, int, int], tuple[int, int]]:
    """Pair every communication action with its counterpart's (rank, step index)."""
    pp = len(schedules)
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    for rank, steps in enumerate(schedules):
        for i, step in enumerate(steps):
            for j, a in enumerate(step):
                if a.is_compute:
                    continue
                side = sends if a.kind.startswith("SEND") else recvs
                side[_channel(rank, a)].append((rank, i, j, a))
    partner: dict[tuple[int, int, int], tuple[int, int]] = {}
    for ch in sorted(set(sends) | set(recvs)):
        s, r = sends.get(ch, []), recvs.get(ch, [])
        for k, (snd, rcv) in enumerate(zip(s, r)):
            if _slot(snd[0], snd[3], pp, placement) != _slot(rcv[0], rcv[3], pp, placement):
                raise ScheduleError(
                    f"mismatch on channel {ch[0]}->{ch[1]} ({ch[2]}), message {k}: rank "
                    f"{snd[0]} sends {snd[3]} (step {snd[1]}) but rank {rcv[0]} receives it as "
                    f"{rcv[3]} (step {rcv[1]})")
            partner[snd[:3]] = rcv[:2]
            partner[rcv[:3]] = snd[:2]
        if len(s) != len(r):
            extra = s[len(r):] or r[len(s):]
            what = "send" if len(s) > len(r) else "receive"
            rank, i, _, a = extra[0]
            raise ScheduleError(
                f"unmatched {what} on channel {ch[0]}->{ch[1]} ({ch[2]}): rank {rank} step {i} "
                f"{a} has no matching {'receive' if what == 'send' else 'send'} "
                f"({len(s)} sends, {len(r)} receives)")
    return partner


def _match_untagged(schedules: list[list[Step]], placement: str = "loop") -> None:
    """Per (source, destination) pair, sends and receives in posting order carry the same
    slots, whatever their direction (tag)."""
    pp = len(schedules)
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for rank, steps in enumerate(schedules):
        for i, step in enumerate(steps):
            for a in sorted((a for a in step if not a.is_compute),
                            key=lambda a: POST_ORDER[a.kind]):
                src, dst, _ = _channel(rank, a)
                side = sends if a.kind.startswith("SEND") else recvs
                side[(src, dst)].append((_slot(rank, a, pp, placement), rank, i, a))
    for pair in sorted(set(sends) | set(recvs)):
        for k, (snd, rcv) in enumerate(zip(sends[pair], recvs[pair])):
            if snd[0] != rcv[0]:
                raise ScheduleError(
                    f"ranks {pair[0]}->{pair[1]} without tags, message {k}: rank {snd[1]} "
                    f"sends {snd[3]} (step {snd[2]}) but rank {rcv[1]} receives {rcv[3]} "
                    f"(step {rcv[2]}) in that place; a backend matching per peer in posting "
                    f"order would swap them")


def inflight_bound(pp: int, vpp: int | None, num_microbatches: int, rank: int,
                   group_size: int | None = None) -> int:
    """Most chunk-micro-batches rank ``rank`` may hold in a 1F1B training schedule: its
    warm-up forwards plus the one forward of the steady state (N = ``group_size``, default
    pp, sets the interleaved warm-up)."""
    vpp = vpp or 1
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - rank, total)
    return min(2 * (pp - rank - 1) + (vpp - 1) * (group_size or pp) + 1, total)


def recv_buffer_bound(pp: int, vpp: int | None, rank: int, group_size: int | None = None
                      ) -> tuple[int, int]:
    """Most received tensors (activations, grads) rank ``rank`` may hold before their compute:
    ``N - pp + 1`` for the rank fed round the ring (rank 0's activations, the last rank's
    grads) of an interleaved schedule, one otherwise."""
    ring = (group_size or pp) - pp + 1 if (vpp or 1) > 1 else 1
    return (ring if rank == 0 else 1, ring if rank == pp - 1 else 1)


def check_schedules(
    schedules: list[list[Step]], vpp: int | None, num_microbatches: int,
    forward_only: bool = False, f_time: float = 1.0, b_time: float = 2.0,
    memory_bound: bool = True, group_size: int | None = None, w_time: float | None = None,
    placement: str = "loop", inflight_limits: list[int] | None = None,
    p2p_time: float = 0.0, action_overhead: float = 0.0,
) -> SimResult:
    """Verify the schedules of all ``len(schedules)`` pipeline ranks; return the simulation.
    ``memory_bound=False`` accepts schedules that hold more than 1F1B's in-flight and
    receive-buffer bounds (such as all-forward-all-backward); ``group_size`` is the interleaved
    schedule's micro-batch group size N those bounds use (default pp). ``w_time``: the W part
    of ``b_time`` on ranks that split their backwards (default half of it);
    ``inflight_limits``: the in-flight bound per rank of a schedule that states its own (the
    zero-bubble ones), instead of 1F1B's. ``p2p_time``: what one exchange step costs both
    sides once every peer has posted it (a message's latency: the step ends that long after
    the last post); ``action_overhead``: time each compute action spends outside its compute
    (launch, autograd, bookkeeping), on the rank's clock but not in its busy time. Both 0 by
    default: the proofs and the paper's bubble take free messages and actions."""
    pp, vpp = len(schedules), vpp or 1
    w_time = b_time / 2 if w_time is None else w_time
    _check_work(schedules, vpp, num_microbatches, forward_only, placement)
    partner = _match(schedules, placement)
    split = [any(s[0].kind == "W" for s in steps) for steps in schedules]
    stash = [0] * pp
    # the compute that consumes each received tensor: direction index 0 (F) or 1 (B)
    consumes = {(r, Action(b.kind[-1], b.chunk, b.microbatch)): int(b.kind == "RECV_B")
                for r, steps in enumerate(schedules) for s in steps for b in s
                if b.kind in ("RECV_F", "RECV_B")}
    ptr = [0] * pp
    clock = [0.0] * pp
    posted: dict[tuple[int, int], float] = {}
    inflight = [0] * pp
    pending = [[0, 0] for _ in range(pp)]  # received, not yet consumed: activations, grads
    peak_pending = [[0, 0] for _ in range(pp)]
    res = SimResult(pp, vpp, num_microbatches, busy=[0.0] * pp, peak_inflight=[0] * pp,
                    peak_w_stash=[0] * pp)
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while ptr[r] < len(schedules[r]):
                step = schedules[r][ptr[r]]
                a = step[0]
                if a.is_compute:
                    dur = {"F": f_time, "B": b_time - w_time if split[r] else b_time,
                           "W": w_time}[a.kind]
                    clock[r] += action_overhead
                    res.intervals.append(Interval(r, clock[r], clock[r] + dur, a))
                    if a.kind == "F":
                        inflight[r] += 1
                        res.peak_inflight[r] = max(res.peak_inflight[r], inflight[r])
                    elif a.kind == "B" and split[r]:
                        stash[r] += 1
                        res.peak_w_stash[r] = max(res.peak_w_stash[r], stash[r])
                    else:
                        inflight[r] -= 1
                        stash[r] -= a.kind == "W"
                    if (r, a) in consumes:
                        pending[r][consumes[(r, a)]] -= 1
                    clock[r] += dur
                    res.busy[r] += dur
                    ptr[r] += 1
                    progress = True
                    continue
                if (r, ptr[r]) not in posted:
                    posted[(r, ptr[r])] = clock[r]
                    progress = True
                    for b in step:
                        if b.kind in ("RECV_F", "RECV_B"):
                            d = 0 if b.kind == "RECV_F" else 1
                            pending[r][d] += 1
                            peak_pending[r][d] = max(peak_pending[r][d], pending[r][d])
                peers = [partner[(r, ptr[r], j)] for j in range(len(step))]
                if not all(pr in posted for pr in peers):
                    break
                clock[r] = max([clock[r]] + [posted[pr] for pr in peers]) + p2p_time
                ptr[r] += 1
                progress = True
    if any(ptr[r] < len(schedules[r]) for r in range(pp)):
        raise ScheduleError("deadlock: no rank can make progress\n" + _stuck(schedules, ptr,
                                                                              partner, posted))
    _match_untagged(schedules, placement)
    res.makespan = max(clock) if clock else 0.0
    res.peak_recv_buffers = [(p[0], p[1]) for p in peak_pending]
    if memory_bound and inflight_limits is None:  # a schedule with its own limits: reported
        for r in range(pp):
            bounds = recv_buffer_bound(pp, vpp, r, group_size)
            for d, what in enumerate(("activations", "grads")):
                if peak_pending[r][d] > bounds[d]:
                    raise ScheduleError(
                        f"rank {r} holds {peak_pending[r][d]} received {what} before their "
                        f"compute, more than the {bounds[d]} receive buffer(s) the schedule "
                        f"allows (group size {group_size or pp})")
    if memory_bound and not forward_only:
        for r in range(pp):
            bound = (inflight_limits[r] if inflight_limits is not None
                     else inflight_bound(pp, vpp, num_microbatches, r, group_size))
            if res.peak_inflight[r] > bound:
                raise ScheduleError(
                    f"rank {r} holds {res.peak_inflight[r]} chunk-micro-batches in flight, more "
                    f"than the schedule's bound of {bound} (1F1B's: its warm-up forwards plus "
                    f"one): an extra warm-up forward keeps one more micro-batch's activations "
                    f"alive")
    return res


def _stuck(schedules, ptr, partner, posted) -> str:
    lines = []
    for r, steps in enumerate(schedules):
        if ptr[r] >= len(steps):
            lines.append(f"  rank {r}: done")
            continue
        step = steps[ptr[r]]
        waits = [f"{a} (peer's step {partner[(r, ptr[r], j)][1]} not reached)"
                 for j, a in enumerate(step) if partner[(r, ptr[r], j)] not in posted]
        lines.append(f"  rank {r} at step {ptr[r]} waits for: " + ", ".join(waits))
    return "\n".join(lines)


def render_grid(res: SimResult, cell: int = 6) -> str:
    """The rank x time grid of a simulation: ``F3.1`` is the forward of micro-batch 3 through
    chunk 1, ``.`` an idle slot; an action longer than one time unit continues with ``~``."""
    unit = min((iv.end - iv.start for iv in res.intervals), default=1.0)
    width = int(round(res.makespan / unit))
    rows = [["." for _ in range(width)] for _ in range(res.pp)]
    for iv in res.intervals:
        first, last = int(round(iv.start / unit)), int(round(iv.end / unit))
        rows[iv.rank][first] = str(iv.action)
        for t in range(first + 1, last):
            rows[iv.rank][t] = "~"
    header = "rank | " + "".join(f"{t:<{cell}}" for t in range(width))
    lines = [header]
    for r, row in enumerate(rows):
        lines.append(f"{r:>4} | " + "".join(f"{c:<{cell}}" for c in row))
    for r in range(res.pp):
        recv = (f", receive buffers {res.peak_recv_buffers[r][0]} activations "
                f"{res.peak_recv_buffers[r][1]} grads" if res.peak_recv_buffers else "")
        lines.append(f"rank {r}: busy {res.busy[r]:g}, idle {res.idle[r]:g} "
                     f"(bubble {res.bubble_fraction[r]:.3f}), peak in-flight "
                     f"{res.peak_inflight[r]} chunk-micro-batches{recv}")
    return "\n".join(lines)
