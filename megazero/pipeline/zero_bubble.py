"""Zero-bubble pipeline schedules as data: ZB-H1, ZBV, DualPipeV, and 1F1B with the weight
gradients delayed (Megatron's ``--delay-wgrad-compute``).

Each rank's backward of a (chunk, micro-batch) is split into ``B`` (the input gradient, which
the previous stage waits for) and ``W`` (the weight gradients, which nothing waits for); W
work fills the idle slots 1F1B leaves (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024). The schedules are built in two steps:

1. **Compute order**, per rank, with unit costs (the paper's F = B = W assumption). ZB-H1
   (:func:`fill_with_w`) keeps 1F1B's order of F and B and puts each W where the rank would
   wait, or before a forward that would take the rank past 1F1B's peak of ``pp``
   micro-batches between F and W: the bubble falls to a third of 1F1B's for ``m >= pp``.
   ZBV (:func:`greedy_orders`) puts two chunks per rank in a V and list-schedules F, B and W:
   every rank picks, whenever it is free, a ready B, else a ready F within its limit of
   ``2 pp`` chunk-micro-batches (1F1B's peak), else the oldest W.
   :func:`dualpipev_orders` writes down DeepSeek's DualPipeV order (its eight phases, each
   steady-state slot a forward of one chunk paired with the backward of the other).
2. **Communication**, from the order: :func:`compile_orders` runs the orders with unit costs
   and posts every message in one communication step at the time it is produced, on the
   sender and on the receiver alike. All ranks then meet at every time boundary with matching
   steps, so the steps pair up in time order: no deadlock, first-in first-out per channel, by
   construction (and :func:`megazero.pipeline.checker.check_schedules` proves it again).
   In the V the last rank hands its activation (and the grad back) to itself, without a
   message.

Minimum micro-batch counts (:func:`min_microbatches`): DualPipeV's order needs ``2 pp`` (as
DeepSeek's); the others run any number. :func:`schedule_steps` is what the executor, the
planner and ``tools/schedule_grid.py`` ask for a rank's steps under any ``--pipeline-schedule``.
"""

from __future__ import annotations

import functools

from megazero.config import ConfigError
from megazero.config.rules import schedule_min_microbatches
from megazero.pipeline.combined import combined_steps, fused_forwards
from megazero.pipeline.schedules import (
    POST_ORDER,
    Action,
    Step,
    build_schedule,
    one_f_one_b,
    stage_owner,
    virtual_stage,
)

#: schedule name -> (placement, chunks per rank)
ZERO_BUBBLE = {"zb-h1": ("loop", 1), "zbv": ("v", 2), "dualpipev": ("v", 2)}


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step ``schedule`` runs (the config's rule)."""
    return schedule_min_microbatches(schedule, pp)


def inflight_limits(schedule: str, pp: int, num_microbatches: int) -> list[int]:
    """Most chunk-micro-batches (F done, W not yet) each rank may hold: 1F1B's ``pp - rank``
    with the W delayed (``--delay-wgrad-compute``); 1F1B's peak, rank 0's ``pp``, on every rank
    for ZB-H1 (the paper's "H1": no more memory than 1F1B's peak) and ``2 pp`` chunk halves
    for ZBV; DualPipeV's order holds ``2 pp + 1`` (half a stage more than 1F1B's peak)."""
    m = num_microbatches
    if schedule == "1f1b":
        return [min(pp - r, m) for r in range(pp)]
    if schedule == "zb-h1":
        return [min(pp, m)] * pp
    if schedule == "zbv":
        return [min(2 * pp, 2 * m)] * pp
    return [min(2 * pp + 1, 2 * m)] * pp


def _key(rank: int, a: Action) -> tuple[int, str, int, int]:
    return (rank, a.kind, a.chunk, a.microbatch)


class _Deps:
    """When each compute may start, given the end times of those already placed."""

    def __init__(self, pp: int, vpp: int, placement: str):
        self.pp, self.vpp, self.placement = pp, vpp, placement
        self.last = pp * vpp - 1
        self.end: dict[tuple[int, str, int, int], int] = {}

    def ready(self, rank: int, a: Action) -> int | None:
        """The earliest start, or ``None`` while a dependency is not placed yet."""
        v = virtual_stage(rank, a.chunk, self.pp, self.placement)
        mb = a.microbatch
        if a.kind == "F":
            if v == 0:
                return 0
            r, c = stage_owner(v - 1, self.pp, self.placement)
            return self.end.get((r, "F", c, mb))
        if a.kind == "W":
            return self.end.get((rank, "B", a.chunk, mb))
        own = self.end.get((rank, "F", a.chunk, mb))
        if own is None or v == self.last:
            return own
        r, c = stage_owner(v + 1, self.pp, self.placement)
        t = self.end.get((r, "B", c, mb))
        return None if t is None else max(t, own)


def compile_orders(orders: list[list[Action]], vpp: int, placement: str,
                   combined: bool = False) -> list[list[Step]]:
    """Each rank's steps from its compute order (see the module docstring, step 2).

    ``combined`` (``--overlap-moe-expert-parallel-comm``): every forward followed in the order
    by a backward of another micro-batch runs with it as one unit of two time units
    (:mod:`megazero.combined_1f1b`), its messages leaving at the unit's end, as DualPipe's F&B
    chunks send theirs; a message that arrives during a unit is received after it."""
    pp = len(orders)
    deps = _Deps(pp, vpp, placement)
    start: dict[tuple[int, str, int, int], int] = {}
    fused = [set(fused_forwards(o)) if combined else set() for o in orders]
    ptr, free = [0] * pp, [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                unit = orders[r][ptr[r]:ptr[r] + (2 if ptr[r] in fused[r] else 1)]
                ready = [deps.ready(r, a) for a in unit]
                if any(t is None for t in ready):
                    break
                s = max([free[r], *(t for t in ready if t is not None)])
                for i, a in enumerate(unit):
                    start[_key(r, a)], deps.end[_key(r, a)] = s + i, s + len(unit)
                free[r] = s + len(unit)
                ptr[r] += len(unit)
                progress = True
    stuck = [f"rank {r} at {orders[r][ptr[r]]}" for r in range(pp) if ptr[r] < len(orders[r])]
    if stuck:
        raise ValueError("compute orders wait on each other: " + ", ".join(stuck))
    comms: list[dict[int, list[Action]]] = [{} for _ in range(pp)]
    for (r, kind, c, mb), t in deps.end.items():
        v = virtual_stage(r, c, pp, placement)
        if kind == "F" and v < deps.last:
            r2, c2 = stage_owner(v + 1, pp, placement)
            if r2 != r:
                comms[r].setdefault(t, []).append(Action("SEND_F", c, mb, r2))
                comms[r2].setdefault(t, []).append(Action("RECV_F", c2, mb, r))
        elif kind == "B" and v > 0:
            r2, c2 = stage_owner(v - 1, pp, placement)
            if r2 != r:
                comms[r].setdefault(t, []).append(Action("SEND_B", c, mb, r2))
                comms[r2].setdefault(t, []).append(Action("RECV_B", c2, mb, r))
    out: list[list[Step]] = []
    for r in range(pp):
        # a message arriving in the middle of a unit is received at its end
        inside = {start[_key(r, orders[r][k])] + 1: start[_key(r, orders[r][k])] + 2
                  for k in fused[r]}
        posted: dict[int, list[Action]] = {}
        for t, actions in comms[r].items():
            posted.setdefault(inside.get(t, t), []).extend(actions)
        at = {start[_key(r, a)]: a for a in orders[r]}
        steps: list[Step] = []
        for t in sorted(set(at) | set(posted)):
            if t in posted:
                steps.append(tuple(sorted(posted[t], key=lambda a: POST_ORDER[a.kind])))
            if t in at:
                steps.append((at[t],))
        out.append(steps)
    return out


def greedy_orders(pp: int, num_microbatches: int, vpp: int, placement: str,
                  limits: list[int], f_first: bool = False) -> list[list[Action]]:
    """Unit-cost list scheduling (module docstring, step 1). Forwards go through each chunk in
    micro-batch order, the deeper chunk first; backwards oldest first, the deeper chunk first;
    W oldest first. ``f_first`` prefers a ready forward to a ready backward."""
    m = num_microbatches
    deps = _Deps(pp, vpp, placement)
    orders: list[list[Action]] = [[] for _ in range(pp)]
    next_f = [[0] * vpp for _ in range(pp)]
    held = [0] * pp
    stash: list[list[Action]] = [[] for _ in range(pp)]
    waiting_b: list[list[Action]] = [[] for _ in range(pp)]
    total = 3 * m * vpp * pp
    t = done = 0
    depth = [sorted(range(vpp), key=lambda c: -virtual_stage(r, c, pp, placement))
             for r in range(pp)]
    while done < total:
        if t > 4 * total + 10:
            raise ValueError(f"no schedule found for pp={pp}, m={m}, limits {limits}")
        for r in range(pp):
            if orders[r] and deps.end[_key(r, orders[r][-1])] > t:
                continue
            choice = None
            ready_b = [a for a in waiting_b[r] if (s := deps.ready(r, a)) is not None and s <= t]
            ready_b.sort(key=lambda a: (a.microbatch, depth[r].index(a.chunk)))
            ready_f = None
            if held[r] < limits[r]:
                for c in depth[r]:
                    if next_f[r][c] < m:
                        a = Action("F", c, next_f[r][c])
                        s = deps.ready(r, a)
                        if s is not None and s <= t:
                            ready_f = a
                            break
            picks = [ready_f, ready_b[0] if ready_b else None] if f_first else \
                [ready_b[0] if ready_b else None, ready_f]
            choice = next((a for a in picks if a is not None), None)
            if choice is None and stash[r]:
                choice = stash[r].pop(0)
            if choice is None:
                continue
            orders[r].append(choice)
            deps.end[_key(r, choice)] = t + 1
            done += 1
            if choice.kind == "F":
                next_f[r][choice.chunk] += 1
                held[r] += 1
                waiting_b[r].append(Action("B", choice.chunk, choice.microbatch))
            elif choice.kind == "B":
                waiting_b[r].remove(choice)
                stash[r].append(Action("W", choice.chunk, choice.microbatch))
            else:
                held[r] -= 1
        t += 1
    return orders


def dualpipev_orders(pp: int, num_microbatches: int) -> list[list[Action]]:
    """DeepSeek's DualPipeV order (``dualpipev.py``), chunk 0 the first half of the V. A
    backward without zero-bubble splitting is B followed at once by its W; a split one leaves
    its W to a queue that ``W`` slots drain oldest first."""
    return [_dualpipev_rank(pp, num_microbatches, r) for r in range(pp)]


def _dualpipev_rank(pp: int, m: int, r: int) -> list[Action]:
    seq: list[Action] = []
    nf, nb = [0, 0], [0, 0]
    queue: list[Action] = []

    def f(c: int) -> None:
        seq.append(Action("F", c, nf[c]))
        nf[c] += 1

    def b(c: int, zb: bool = False) -> None:
        seq.append(Action("B", c, nb[c]))
        (queue if zb else seq).append(Action("W", c, nb[c]))
        nb[c] += 1

    def w() -> None:
        seq.append(queue.pop(0))

    for _ in range(2 * (pp - r - 1)):  # 1: chunk-0 forwards
        f(0)
    for _ in range(r + 1):  # 2: forwards of both chunks
        f(0)
        f(1)
    for _ in range(pp - r - 1):  # 3: B, W, F of chunk 1
        b(1, zb=True)
        w()
        f(1)
    for _ in range(m - 2 * pp + r + 1):  # 4: steady state, F of one chunk with B of the other
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(pp - r - 1):  # 5
        b(1)
        f(1)
        b(0)
    zb = False
    for i in range(r + 1):  # 6: backwards of both chunks, the later half split
        if i == (r + 1) // 2 and r % 2 == 1:
            zb = True
        b(1, zb)
        if i == (r + 1) // 2 and r % 2 == 0:
            zb = True
        b(0, zb)
    for _ in range(pp - r - 1):  # 7
        w()
        b(0, zb=True)
    while queue:  # 8
        w()
    return seq


def delayed_wgrad(steps: list[Step]) -> list[Step]:
    """1F1B with each backward's weight gradients after the communication step that follows
    it (Megatron's ``--delay-wgrad-compute``: the input grad leaves before the W GEMMs)."""
    out: list[Step] = []
    pending: Action | None = None
    for step in steps:
        if pending is not None and step[0].is_compute:
            out.append((pending,))
            pending = None
        out.append(step)
        if step[0].kind == "B":
            pending = Action("W", step[0].chunk, step[0].microbatch)
        elif pending is not None:
            out.append((pending,))
            pending = None
    if pending is not None:
        out.append((pending,))
    return out


def zero_bubble_schedule(schedule: str, pp: int, num_microbatches: int,
                         forward_only: bool = False, combined: bool = False
                         ) -> list[list[Step]]:
    """Every rank's steps of ``schedule`` (one of :data:`ZERO_BUBBLE`); ``combined``: with
    each forward and the backward after it as one unit (:func:`compile_orders`)."""
    placement, vpp = ZERO_BUBBLE[schedule]
    lowest = min_microbatches(schedule, pp)
    if num_microbatches < lowest:
        raise ConfigError(
            f"--pipeline-schedule {schedule} needs at least {lowest} micro-batches per step at "
            f"pipeline size {pp} (got {num_microbatches}); raise --global-batch-size to "
            f"{lowest} x --micro-batch-size x data-parallel size or more, or use zbv")
    if forward_only:
        orders = [[Action("F", c, mb) for mb in range(num_microbatches)
                   for c in sorted(range(vpp), key=lambda c: virtual_stage(r, c, pp, placement))]
                  for r in range(pp)]
    elif schedule == "dualpipev":
        orders = dualpipev_orders(pp, num_microbatches)
    elif schedule == "zb-h1":
        fb = [[s[0] for s in one_f_one_b(pp, num_microbatches, r) if s[0].is_compute]
              for r in range(pp)]
        orders = fill_with_w(fb, vpp, placement, inflight_limits(schedule, pp, num_microbatches))
    else:
        orders = greedy_orders(pp, num_microbatches, vpp, placement,
                               inflight_limits(schedule, pp, num_microbatches))
    return compile_orders(orders, vpp, placement, combined and not forward_only)


def fill_with_w(fb_orders: list[list[Action]], vpp: int, placement: str, limits: list[int]
                ) -> list[list[Action]]:
    """Keep each rank's F/B order (1F1B's for ZB-H1) and place every W where the rank would
    otherwise wait: in an idle slot, or before a forward that would exceed the rank's limit of
    micro-batches between their F and their W; the rest after the last backward."""
    pp = len(fb_orders)
    deps = _Deps(pp, vpp, placement)
    orders: list[list[Action]] = [[] for _ in range(pp)]
    ptr, held = [0] * pp, [0] * pp
    stash: list[list[Action]] = [[] for _ in range(pp)]
    total = sum(len(o) for o in fb_orders) * 3 // 2
    t = done = 0
    while done < total:
        if t > 4 * total + 10:
            raise ValueError("compute orders wait on each other")
        for r in range(pp):
            if orders[r] and deps.end[_key(r, orders[r][-1])] > t:
                continue
            nxt = fb_orders[r][ptr[r]] if ptr[r] < len(fb_orders[r]) else None
            s = deps.ready(r, nxt) if nxt is not None else None
            choice: Action | None = None
            if nxt is not None and s is not None and s <= t and not (
                    nxt.kind == "F" and held[r] >= limits[r] and stash[r]):
                choice = nxt
                ptr[r] += 1
            elif stash[r]:
                choice = stash[r].pop(0)
            if choice is None:
                continue
            orders[r].append(choice)
            deps.end[_key(r, choice)] = t + 1
            done += 1
            if choice.kind == "F":
                held[r] += 1
            elif choice.kind == "B":
                stash[r].append(Action("W", choice.chunk, choice.microbatch))
            else:
                held[r] -= 1
        t += 1
    return orders


def placement_of(schedule: str | None) -> str:
    """Where a schedule puts its chunks (a property of the schedule)."""
    return ZERO_BUBBLE[schedule][0] if schedule in ZERO_BUBBLE else "loop"


@functools.lru_cache(maxsize=64)
def _all_ranks(schedule: str, pp: int, m: int, forward_only: bool, combined: bool
               ) -> list[list[Step]]:
    return zero_bubble_schedule(schedule, pp, m, forward_only, combined)


def schedule_steps(pp: int, vpp: int | None, num_microbatches: int, pp_rank: int,
                   forward_only: bool = False, group_size: int | None = None,
                   schedule: str | None = None, delay_wgrad: bool = False,
                   combined: bool = False) -> list[Step]:
    """The steps of one pipeline rank for any ``--pipeline-schedule`` (``None``: 1F1B, or
    interleaved when ``vpp`` is given, as :func:`~megazero.pipeline.schedules.build_schedule`);
    ``delay_wgrad`` runs 1F1B with each W after its backward's communication; ``combined``
    (``--overlap-moe-expert-parallel-comm``) puts each forward next to the backward it runs
    with (:func:`megazero.pipeline.combined.combined_steps`)."""
    if schedule in ZERO_BUBBLE and pp > 1:
        return list(_all_ranks(schedule, pp, num_microbatches, forward_only,
                               combined)[pp_rank])
    # under the combined 1F1B the interleaved schedule warms up one chunk-forward more, so
    # that the last rank's forwards meet an earlier micro-batch's backward, not their own
    extra = int(combined and pp > 1 and (vpp or 1) > 1)
    steps = build_schedule(pp, vpp, num_microbatches, pp_rank, forward_only, group_size, extra)
    steps = delayed_wgrad(steps) if delay_wgrad and not forward_only else steps
    return combined_steps(steps) if combined and not forward_only else steps


def all_schedule_steps(pp: int, vpp: int | None, num_microbatches: int,
                       forward_only: bool = False, group_size: int | None = None,
                       schedule: str | None = None, delay_wgrad: bool = False,
                       combined: bool = False) -> list[list[Step]]:
    """:func:`schedule_steps` of every rank."""
    return [schedule_steps(pp, vpp, num_microbatches, r, forward_only, group_size, schedule,
                           delay_wgrad, combined) for r in range(pp)]


@functools.lru_cache(maxsize=256)
def bubble_units(schedule: str, pp: int, num_microbatches: int,
                 delay_wgrad: bool = False) -> float:
    """The longest any rank idles in one step of ``schedule``, in micro-batches of a whole
    stage's compute (F + B + W), from the checker's simulation with F = B = W: ``pp - 1``
    for 1F1B, a third of it for ZB-H1. The planner prices the bubble with it. Past ``4 pp``
    micro-batches the idle time no longer grows (the steady state has none), so longer steps
    are simulated at ``4 pp``."""
    from megazero.pipeline.checker import check_schedules

    m = min(num_microbatches, 4 * pp)
    placement, vpp = ZERO_BUBBLE.get(schedule, ("loop", 1))
    steps = all_schedule_steps(pp, vpp if vpp > 1 else None, m, schedule=schedule,
                               delay_wgrad=delay_wgrad)
    f = 1.0 / vpp
    res = check_schedules(steps, vpp, m, f_time=f, b_time=2 * f, w_time=f,
                          placement=placement, memory_bound=False)
    return max(res.idle) / 3
