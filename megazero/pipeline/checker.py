"""Prove a pipeline schedule correct by simulating every rank, without processes.

:func:`check_schedules` takes all ranks' step lists (see :mod:`megazero.pipeline.schedules`)
and verifies, raising :class:`ScheduleError` with a readable reason otherwise:

1. **Work**: each rank runs the forward and the backward of every (chunk, micro-batch) exactly
   once (forwards only in forward-only mode), each backward after its forward.
2. **Local data flow**: a chunk's forward comes after the receive of its input activation,
   a send of an activation after the forward that made it, a backward after the receive of its
   output grad, and the send of an input grad after that backward.
3. **Matching**: messages on each channel (source rank, destination rank, forward or backward
   direction) are matched first-in first-out, as point-to-point messages with one tag are; the
   i-th send and the i-th receive must carry the same slot (direction, producing virtual stage,
   micro-batch), so the receiver gets the tensor it thinks it gets.
4. **No deadlock**: ranks are advanced with blocking semantics. A communication step posts all
   its sends and receives at once and completes only when every one of them has been posted by
   the peer (rendezvous: a send is treated as blocking until its receive is posted, the strict
   NCCL-like assumption). If no rank can advance before all are done, the schedule deadlocks;
   the error lists what each stuck rank waits for.

5. **Memory bound** (training schedules, unless ``memory_bound=False``): no rank holds more
   micro-batches in flight than 1F1B's warm-up allows (:func:`inflight_bound`: ``pp - rank``
   without interleaving, Megatron's ``2(pp - rank - 1) + (vpp - 1)pp`` warm-up plus one with
   it). A schedule with one extra warm-up forward is still correct and deadlock-free, but
   holds one more micro-batch's activations than the memory estimates promise.

The same simulation gives a timeline (forward cost ``f_time``, backward ``b_time``,
communication free), hence each rank's idle time (the bubble) and its peak number of
micro-batches in flight (forwards whose backward has not finished: the activations it holds).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from megazero.pipeline.schedules import Action, Step, virtual_stage


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


def _slot(rank: int, a: Action, pp: int) -> tuple[str, int, int]:
    """What a message carries: direction, the virtual stage that produced it, micro-batch."""
    v = virtual_stage(rank, a.chunk, pp)
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


def _check_work(schedules: list[list[Step]], vpp: int, m: int, forward_only: bool) -> None:
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
        for c in range(vpp):
            v = virtual_stage(rank, c, pp)
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
                _check_order(rank, seen, ("RECV_F", c, mb), ("F", c, mb), v > 0)
                _check_order(rank, seen, ("F", c, mb), ("SEND_F", c, mb), v < last_v)
                if not forward_only:
                    _check_order(rank, seen, ("RECV_B", c, mb), ("B", c, mb), v < last_v)
                    _check_order(rank, seen, ("B", c, mb), ("SEND_B", c, mb), v > 0)


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


def _match(schedules: list[list[Step]]) -> dict[tuple[int, int, int], tuple[int, int]]:
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
            if _slot(snd[0], snd[3], pp) != _slot(rcv[0], rcv[3], pp):
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


def inflight_bound(pp: int, vpp: int | None, num_microbatches: int, rank: int) -> int:
    """Most chunk-micro-batches rank ``rank`` may hold in a 1F1B training schedule: its
    warm-up forwards plus the one forward of the steady state."""
    vpp = vpp or 1
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - rank, total)
    if num_microbatches == pp:  # one group of micro-batches: all warm-up
        return total
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, total)


def check_schedules(
    schedules: list[list[Step]], vpp: int | None, num_microbatches: int,
    forward_only: bool = False, f_time: float = 1.0, b_time: float = 2.0,
    memory_bound: bool = True,
) -> SimResult:
    """Verify the schedules of all ``len(schedules)`` pipeline ranks; return the simulation.
    ``memory_bound=False`` accepts schedules that hold more than 1F1B's in-flight bound
    (such as all-forward-all-backward)."""
    pp, vpp = len(schedules), vpp or 1
    _check_work(schedules, vpp, num_microbatches, forward_only)
    partner = _match(schedules)
    ptr = [0] * pp
    clock = [0.0] * pp
    posted: dict[tuple[int, int], float] = {}
    inflight = [0] * pp
    res = SimResult(pp, vpp, num_microbatches, busy=[0.0] * pp, peak_inflight=[0] * pp)
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while ptr[r] < len(schedules[r]):
                step = schedules[r][ptr[r]]
                a = step[0]
                if a.is_compute:
                    dur = f_time if a.kind == "F" else b_time
                    res.intervals.append(Interval(r, clock[r], clock[r] + dur, a))
                    if a.kind == "F":
                        inflight[r] += 1
                        res.peak_inflight[r] = max(res.peak_inflight[r], inflight[r])
                    else:
                        inflight[r] -= 1
                    clock[r] += dur
                    res.busy[r] += dur
                    ptr[r] += 1
                    progress = True
                    continue
                if (r, ptr[r]) not in posted:
                    posted[(r, ptr[r])] = clock[r]
                    progress = True
                peers = [partner[(r, ptr[r], j)] for j in range(len(step))]
                if not all(pr in posted for pr in peers):
                    break
                clock[r] = max([clock[r]] + [posted[pr] for pr in peers])
                ptr[r] += 1
                progress = True
    if any(ptr[r] < len(schedules[r]) for r in range(pp)):
        raise ScheduleError("deadlock: no rank can make progress\n" + _stuck(schedules, ptr,
                                                                              partner, posted))
    res.makespan = max(clock) if clock else 0.0
    if memory_bound and not forward_only:
        for r in range(pp):
            bound = inflight_bound(pp, vpp, num_microbatches, r)
            if res.peak_inflight[r] > bound:
                raise ScheduleError(
                    f"rank {r} holds {res.peak_inflight[r]} chunk-micro-batches in flight, more "
                    f"than 1F1B's bound of {bound} (its warm-up forwards plus one): an extra "
                    f"warm-up forward keeps one more micro-batch's activations alive")
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
        lines.append(f"rank {r}: busy {res.busy[r]:g}, idle {res.idle[r]:g} "
                     f"(bubble {res.bubble_fraction[r]:.3f}), peak in-flight "
                     f"{res.peak_inflight[r]} chunk-micro-batches")
    return "\n".join(lines)
