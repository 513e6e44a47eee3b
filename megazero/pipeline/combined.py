"""Which forward and backward steps of a rank's schedule run together as a combined 1F1B pair.

A forward ``F`` and a backward ``B`` pair when ``B`` comes right after ``F`` in the rank's
steps, possibly behind communication steps, and they belong to different micro-batches (so
neither needs the other). :func:`combined_steps` makes the pairs adjacent:

* **no pipelining** (no communication steps): gradient accumulation runs ``F0 B0 F1 B1 ...``;
  the combined order is ``F0``, then ``F(k)`` with ``B(k-1)`` for ``k = 1 .. m-1``, then
  ``B(m-1)`` (megatron-core's combined 1F1B without pipelining). The backwards keep their
  order, so the gradients accumulate in the same order; one micro-batch more is held at once.
* **interleaved**: the steady state runs each forward right before a backward of an earlier
  micro-batch and exchanges after both. With megatron-core's warm-up the last rank's
  loss-chunk forwards meet their own micro-batch's backward, which cannot pair; the
  combined schedule warms up one chunk-forward more on every rank (as megatron-core's
  combined 1F1B does: :func:`megazero.pipeline.schedules.build_schedule`'s
  ``extra_warmup``), so every steady-state slot pairs, for one more chunk-micro-batch held.
* **DualPipeV**: its order is compiled again with each forward and the backward after it as
  one unit whose messages leave at its end (:func:`fused_forwards`,
  :func:`megazero.pipeline.zero_bubble.compile_orders`), as DualPipe's F&B chunks send
  theirs: every steady-state slot pairs. Holding the sends of the schedule compiled for
  single actions instead would delay each peer by a backward.

:func:`pair_at` tells the executor whether steps ``i`` and ``i + 1`` are a pair.
"""

from __future__ import annotations

from megazero.pipeline.schedules import Action, Step


def _compute(step: Step, kind: str) -> Action | None:
    return step[0] if len(step) == 1 and step[0].kind == kind else None


def pair_at(steps: list[Step], i: int) -> tuple[Action, Action] | None:
    """``(F, B)`` when steps ``i`` and ``i + 1`` are a forward and a backward of different
    micro-batches (a combined 1F1B pair), else None."""
    if i + 1 >= len(steps):
        return None
    f, b = _compute(steps[i], "F"), _compute(steps[i + 1], "B")
    if f is None or b is None or f.microbatch == b.microbatch:
        return None
    return f, b


def fused_forwards(order: list[Action]) -> list[int]:
    """Indices ``k`` of a rank's compute order whose forward runs with the backward at
    ``k + 1`` (another micro-batch's): DualPipeV's F&B units (see
    :func:`megazero.pipeline.zero_bubble.compile_orders`)."""
    out: list[int] = []
    k = 0
    while k + 1 < len(order):
        a, b = order[k], order[k + 1]
        if a.kind == "F" and b.kind == "B" and a.microbatch != b.microbatch:
            out.append(k)
            k += 2
        else:
            k += 1
    return out


def _accumulation_order(steps: list[Step]) -> list[Step]:
    """No pipelining: ``F0, (F1, B0), (F2, B1), ..., B(m-1)``, each backward's ``W`` (if
    any) right after it, as before."""
    groups: list[list[Step]] = []  # per micro-batch: its F, its B, its W if any
    for step in steps:
        if step[0].kind == "F":
            groups.append([step])
        else:
            groups[-1].append(step)
    if any(len(g) < 2 for g in groups):  # forward only: nothing to pair
        return steps
    out: list[Step] = [groups[0][0]]
    for prev, cur in zip(groups, groups[1:]):
        out += [cur[0], *prev[1:]]
    out += groups[-1][1:]
    return out


def combined_steps(steps: list[Step]) -> list[Step]:
    """The rank's steps in combined 1F1B order (see the module docstring): gradient
    accumulation reordered so that each forward meets the previous micro-batch's backward;
    pipeline schedules as they are."""
    if all(s[0].is_compute for s in steps):
        return _accumulation_order(steps)
    return list(steps)


def pair_count(steps: list[Step]) -> int:
    """How many pairs the executor runs in ``steps`` (already :func:`combined_steps`)."""
    n, i = 0, 0
    while i < len(steps):
        if pair_at(steps, i) is not None:
            n += 1
            i += 2
        else:
            i += 1
    return n
