"""Print a pipeline schedule as a rank x time grid, after checking it.

    python tools/schedule_grid.py --pp 4 --vpp 2 --microbatches 8
    python tools/schedule_grid.py --pp 4 --vpp 2 --microbatches 10 --group-size 5
    python tools/schedule_grid.py --pp 4 --microbatches 8 --schedule zbv

``F3.1`` is the forward of micro-batch 3 through model chunk 1; ``B`` a backward; ``.`` an idle
slot; ``~`` the continuation of a longer action (backward costs ``--b-time`` units, forward
``--f-time``; a split backward is B and ``W``, ``--w-time`` of it the W). ``--schedule`` takes
the ``--pipeline-schedule`` names (the V ones place two chunks per rank, chunk 1 at stage
``2 pp - 1 - rank``; their grid shows chunks as they sit there). The footer gives each rank's
bubble and peak micro-batches in flight, and the formula the bubble should match. ``--steps``
also prints each rank's raw step list, with the batched sends/receives.
"""

from __future__ import annotations

import argparse
import sys

from megazero.config import ConfigError
from megazero.pipeline.checker import ScheduleError, check_schedules, render_grid
from megazero.pipeline.zero_bubble import (
    ZERO_BUBBLE,
    all_schedule_steps,
    inflight_limits,
    placement_of,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    ap.add_argument("--vpp", type=int, default=1,
                    help="virtual chunks per stage (>1: interleaved 1F1B)")
    ap.add_argument("--microbatches", type=int, required=True,
                    help="micro-batches per iteration")
    ap.add_argument("--group-size", type=int, default=None,
                    help="interleaved: micro-batches per group (megatron-core's "
                         "--microbatch-group-size-per-virtual-pipeline-stage; default pp)")
    ap.add_argument("--forward-only", action="store_true",
                    help="the evaluation schedule (no backward passes)")
    ap.add_argument("--f-time", type=float, default=1.0, help="time units of one forward")
    ap.add_argument("--b-time", type=float, default=2.0, help="time units of one backward")
    ap.add_argument("--w-time", type=float, default=None,
                    help="time units of W in a split backward (default half the backward)")
    ap.add_argument("--schedule", default=None,
                    choices=("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"),
                    help="--pipeline-schedule (default: 1f1b, or interleaved with --vpp > 1)")
    ap.add_argument("--delay-wgrad", action="store_true",
                    help="1F1B with each W after its backward's exchange")
    ap.add_argument("--steps", action="store_true", help="also print every rank's step list")
    args = ap.parse_args(argv)
    zb = args.schedule in ZERO_BUBBLE
    vpp = ZERO_BUBBLE[args.schedule][1] if zb else args.vpp
    try:
        schedules = all_schedule_steps(args.pp, vpp, args.microbatches, args.forward_only,
                                       args.group_size, args.schedule, args.delay_wgrad)
        res = check_schedules(
            schedules, vpp, args.microbatches, args.forward_only, args.f_time, args.b_time,
            group_size=args.group_size, w_time=args.w_time,
            placement=placement_of(args.schedule),
            inflight_limits=inflight_limits(args.schedule, args.pp, args.microbatches)
            if zb else None)
    except (ConfigError, ScheduleError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(render_grid(res))
    if not args.forward_only and not zb:
        print(f"formula bubble (p-1)/(v*m) = {(args.pp - 1) / (vpp * args.microbatches):.3f}")
    if args.steps:
        for r, steps in enumerate(schedules):
            print(f"rank {r}: " + " | ".join(" ".join(map(str, s)) for s in steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
