"""Pick a parallel layout before launching: every axis searched, the fastest that fit ranked.

    python tools/plan_layout.py --model llama2-7b --world-size 8 --cluster h100-80gb-nvlink \
        --global-batch-size 256 --bf16 [--top 10] [--out-dir plan/] [--measure K]

The search (megazero/planner/search.py) covers tensor, context (for long sequences), pipeline
(1F1B and interleaved), expert and expert-tensor (MoE models) parallelism, sequence
parallelism, micro-batch size, ZeRO stage, optimizer offload and recomputation; axes given as
flags stay fixed. A progress bar on stderr shows the layouts tried, the best so far and the
time left. Prints the top layouts as a table with why each loses to the winner, says in which
time terms the winner beats the runner-up (for an MoE model whose winner has no expert
parallelism, also the fastest layout with it), and writes the winner as
pretrain_gpt.py flags (``winner_flags.txt``) and a DeepSpeed JSON (``ds_config.json``) into
``--out-dir``. Model and cluster options are those of tools/estimate_memory.py; every other flag
is pretrain_gpt.py's and applies to all candidates. ``--measure K`` launches the top K with
torchrun on this machine for ``--measure-iters`` iterations each (mock data), reports failed
trials and re-ranks by measured time.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimate_memory import gb, run_argv, tool_parser, world_size  # noqa: E402

from megazero.config import ConfigError, load_config  # noqa: E402
from megazero.planner.cluster import load_cluster  # noqa: E402
from megazero.planner.progress import ProgressBar  # noqa: E402
from megazero.planner.search import (  # noqa: E402
    assumptions,
    deepspeed_json,
    runner_up,
    search,
    uses_experts,
    why_slower,
    why_winner,
    winner_flags,
)


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser(__doc__.split("\n")[0])
    ap.add_argument("--global-batch-size", type=int, default=None,
                    help="sequences per iteration (default: the world size)")
    ap.add_argument("--top", type=int, default=10, help="layouts to print")
    ap.add_argument("--out-dir", default=None,
                    help="write the winner's flags and DeepSpeed JSON here")
    ap.add_argument("--measure", type=int, default=0, metavar="K",
                    help="run the top K layouts with torchrun here and re-rank by measured time")
    ap.add_argument("--measure-iters", type=int, default=4,
                    help="iterations per measured trial")
    ap.add_argument("--zero-stages", default="0,1,2,3",
                    help="ZeRO stages to consider, comma-separated (e.g. 0,1 for Megatron-style)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args, rest = ap.parse_known_args(argv)
    from megazero.errors import one_line_warnings

    one_line_warnings("plan_layout.py")
    bar = None if args.no_progress else ProgressBar()
    started = time.monotonic()
    try:
        cluster = load_cluster(args.cluster)
        world = world_size(args, cluster)
        base = run_argv(args, rest)
        gbs = args.global_batch_size or world
        stages = tuple(int(x) for x in args.zero_stages.split(","))
        moe = load_config(base, world).model.moe.enabled
        res = search(base, world, cluster, gbs, stages, keep=max(args.top, 2), progress=bar,
                     also=uses_experts if moe else None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fits = res.fits
    searched = (f"searched {res.timed} layouts of {res.shapes} shapes in "
                f"{time.monotonic() - started:.1f} s")
    if bar is not None:
        bar.done(searched)
    if not res.timed:
        print(f"error: no valid layout of this model on {world} ranks with global batch "
              f"{gbs}", file=sys.stderr)
        return 2
    if not fits:
        best = res.closest
        assert best is not None
        need = best.est.worst.device_total
        print(f"error: the model does not fit on {world} x {cluster.memory_gb:g} GB in any of "
              f"{res.timed} layouts. The closest is {best.label}, needing "
              f"{gb(need).strip()} per device (about {gb(need * world).strip()} in total across "
              f"{world} devices); use devices with >= {gb(need).strip()}, more devices, or a "
              f"smaller model/batch.", file=sys.stderr)
        return 3
    if args.measure:
        from megazero.planner.measure import measure_candidates

        fits = measure_candidates(fits[:args.measure], base, world, args.measure_iters) \
            + fits[args.measure:]
    win = fits[0]
    note = "" if args.global_batch_size else " (default: the world size; --global-batch-size)"
    print(assumptions(win.est.config, note))
    print(f"{searched} ({res.shapes} combinations of tp, cp, pp, schedule, ep, etp, sp), each "
          f"timed; fastest first, {res.pruned} ruled out by their model states and activations "
          f"alone, {res.checked} estimated in full; top {min(args.top, len(fits))} that fit in "
          f"{cluster.memory_gb:g} GB ({cluster.name}) by "
          f"{'measured' if args.measure else 'predicted'} step time:")
    width = max(58, *(len(c.label) + 2 for c in fits[:args.top]))
    print(f"{'#':>3} {'layout':<{width}}{'mem/dev':>10}{'step s':>9}{'MFU':>7}  why slower")
    for i, c in enumerate(fits[:args.top]):
        t = c.est.time
        meas = getattr(c, "measured_s", None)
        step = f"{meas:.3f}*" if meas is not None else f"{t.seconds:.3f}"
        why = "winner" if c is win else why_slower(c, win)
        if getattr(c, "failed", None):
            why = f"trial failed: {c.failed}"
        print(f"{i + 1:>3} {c.label:<{width}}{gb(c.est.worst.device_total):>10}{step:>9}"
              f"{t.mfu:>7.1%}  {why}")
    flags = winner_flags(win, base)
    ds = deepspeed_json(win)
    print(f"\nwinner: {win.label}")
    from megazero.planner.comm_overlap import exposed_comm

    for line in exposed_comm(win.est.config, cluster).lines(win.est.config):
        print(f"  {line}")
    second, ties = runner_up(fits)
    if not args.measure:  # measured ranks: the predicted terms may disagree
        if ties:
            print(f"  ties with {len(ties)} other layout(s) at the same predicted time, e.g. "
                  f"{ties[0].label}")
        if second is not None:
            print(f"  {why_winner(win, second)}")
        if res.also is not None and not uses_experts(win):
            ep = res.also
            gap = ep.est.time.seconds / win.est.time.seconds - 1
            print(f"  fastest with expert parallelism: {ep.label}, {ep.est.time.seconds:.3f} s "
                  f"({gap:.1%} slower: {why_slower(ep, win)}), "
                  f"{gb(ep.est.worst.device_total).strip()} per device")
    print(f"  flags: {flags}\n  ds_config.json: {json.dumps(ds)}")
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "winner_flags.txt").write_text(flags + "\n")
        (out / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
        print(f"  written to {out}/winner_flags.txt and {out}/ds_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
