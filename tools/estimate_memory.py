"""Per-rank memory (itemised), step time, tokens/s and MFU of a run, before launching it.

Takes pretrain_gpt.py's flags (same parser, same validation and messages) plus::

    --world-size N | --num-nodes M --gpus-per-node G
    --model gpt2-125m|gpt2-350m|gpt2-760m|gpt2-1.3b|gpt3-175b|llama2-7b|llama2-13b|
            llama2-70b|llama3-8b
    --hf-config config.json          (a Hugging Face Llama/GPT-2 config instead of --model)
    --cluster h100-80gb-nvlink|a100-80gb|a100-40gb|v100-32gb|cpu|my_cluster.json
    --deepspeed-compat               (also print DeepSpeed's estimate_zero{2,3} numbers)
    --json                           (machine-readable output)

pretrain_gpt.py's flags may follow a literal ``--`` (``... --world-size 8 -- --bf16``).

Example: python tools/estimate_memory.py --model llama2-7b --world-size 8 --bf16 \
    --tensor-model-parallel-size 2 --zero-stage 1 --micro-batch-size 1 --global-batch-size 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megazero.config import (
    ConfigError,  # noqa: E402
    load_config,  # noqa: E402
)
from megazero.planner.cluster import (  # noqa: E402
    builtin_clusters,
    load_cluster,
    planning_argv,
)
from megazero.planner.presets import MODEL_PRESETS, hf_config_argv, preset_argv  # noqa: E402


def tool_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="Every other flag is "
                                 "pretrain_gpt.py's (e.g. --tensor-model-parallel-size, "
                                 "--zero-stage, --bf16, --deepspeed_config ds.json).")
    ap.add_argument("--world-size", type=int, default=None,
                    help="ranks in the job (else --num-nodes x --gpus-per-node)")
    ap.add_argument("--num-nodes", type=int, default=1, help="nodes in the job")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per node (default: the cluster's)")
    ap.add_argument("--model", choices=list(MODEL_PRESETS), default=None,
                    help="a well-known model's shape instead of --num-layers/--hidden-size/...")
    ap.add_argument("--hf-config", default=None,
                    help="a Hugging Face config.json to take the model's shape from")
    ap.add_argument("--cluster", default="h100-80gb-nvlink",
                    help=f"one of {builtin_clusters()} or a JSON file")
    ap.add_argument("--json", action="store_true",
                    help="print the whole estimate as one JSON object (bytes per rank)")
    return ap


def run_argv(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """The preset's flags (less those the user gives) and the user's other flags. A literal
    ``--`` only separates the tool's flags from pretrain_gpt.py's: argparse keeps it in
    ``rest``, where the run's parser would take it, and every flag after it, as unknown."""
    rest = [a for a in rest if a != "--"]
    model = (preset_argv(args.model) if args.model else
             hf_config_argv(args.hf_config) if args.hf_config else [])
    given = {a.split("=")[0] for a in rest if a.startswith("--")}
    kept, skip = [], False
    for i, a in enumerate(model):  # flags the user gives override the preset's
        if skip:
            skip = False
            continue
        if a in given:
            skip = i + 1 < len(model) and not model[i + 1].startswith("--")
            continue
        kept.append(a)
    return kept + rest


def world_size(args: argparse.Namespace, cluster) -> int:
    if args.world_size:
        return args.world_size
    return args.num_nodes * (args.gpus_per_node or cluster.gpus_per_node)


def gb(x: float) -> str:
    return f"{x / 1e9:9.2f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser(__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-compat", action="store_true",
                    help="print what DeepSpeed's estimate_zero2/3_model_states_mem_needs print")
    args, rest = ap.parse_known_args(argv)
    from megazero.errors import one_line_warnings
    from megazero.planner.estimate import estimate

    one_line_warnings("estimate_memory.py")

    try:
        cluster = load_cluster(args.cluster)
        world = world_size(args, cluster)
        cfg = load_config(planning_argv(run_argv(args, rest), cluster), world)
        est = estimate(cfg, cluster)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = est.as_dict()
    from dataclasses import asdict

    from megazero.planner.param_counts import describe, parameter_counts

    out["parameters"] = asdict(parameter_counts(cfg.model))
    if args.deepspeed_compat:
        from dataclasses import replace

        from megazero.config.layout import ParallelLayout
        from megazero.planner.deepspeed_compat import deepspeed_table, model_param_counts
        from megazero.planner.shapes import meta_chunks, shape_topology

        single = replace(cfg, parallel=replace(
            cfg.parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            num_layers_per_virtual_pipeline_stage=None, sequence_parallel=False, world_size=None))
        full = meta_chunks(single, shape_topology(ParallelLayout(1)))[0]
        total, largest = model_param_counts(full)
        nodes = max(1, world // cluster.gpus_per_node)
        out["deepspeed"] = dict(total_params=total, largest_layer_params=largest,
                                rows=deepspeed_table(total, largest, world // nodes, nodes))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    from megazero.planner.estimate import FRAGMENTATION_ITEM, STATE_ITEMS
    from megazero.planner.search import assumptions

    p, w = cfg.parallel, est.worst
    note = "" if cfg.train.global_batch_size else " (default: micro-batch x dp)"
    print(f"cluster {cluster.name} ({cluster.device}, {cluster.memory_gb:g} GB), world {world}: "
          f"tp {p.tp} x pp {p.pp} x dp {cfg.layout().dp}"
          + (f" x cp {p.cp} ({p.cp_comm_type})" if p.cp > 1 else "")
          + f", vpp {cfg.vpp or 1}, ZeRO "
          f"{cfg.zero.stage}, {cfg.precision.params_dtype}".replace("torch.", ""))
    print(assumptions(cfg, note))
    print(f"model: {describe(cfg.model)}")
    print(f"parameters on the worst rank (pp stage {w.pp_rank}): {w.numel:,}")
    print("  model states (held throughout; they add up):")
    for name, v in w.items.items():
        if name in STATE_ITEMS:
            print(f"    {name:<44}{gb(v)}")
    phases = {
        "forward-backward": {k: v for k, v in w.items.items()
                             if k not in STATE_ITEMS and k != FRAGMENTATION_ITEM},
        "grad sync (last micro-batch's backward)": w.sync,
        "optimizer step": w.step,
    }
    largest = max(phases, key=lambda k: sum(phases[k].values()))
    print("  plus the largest of three phases that do not overlap (alternatives, not a sum):")
    for phase, items in phases.items():
        mark = "   <- the peak" if phase == largest else ""
        print(f"    {phase + ':':<44}{gb(sum(items.values()))}{mark}")
        for name, v in items.items():
            print(f"      {name:<42}{gb(v)}")
    if FRAGMENTATION_ITEM in w.items:
        print(f"  plus {FRAGMENTATION_ITEM:<41}{gb(w.items[FRAGMENTATION_ITEM])}")
    print(f"  {'total per device':<46}{gb(w.device_total)}   "
          f"({'fits' if est.fits else 'DOES NOT FIT'} in {cluster.memory_gb:g} GB)")
    for name, v in w.host.items():
        print(f"  host: {name:<28}{gb(v)}")
    t = est.time
    print(f"step time {t.seconds:.3f} s  (" + ", ".join(
        f"{k} {v:.3f}" for k, v in t.terms.items()) + ")")
    print(f"tokens/s {t.tokens_per_s:,.0f}   MFU {t.mfu:.1%}")
    from megazero.planner.comm_overlap import exposed_comm

    for line in exposed_comm(cfg, cluster).lines(cfg):
        print(line)
    if args.deepspeed_compat:
        d = out["deepspeed"]
        print(f"DeepSpeed estimate (total {d['total_params']:,} params, largest layer "
              f"{d['largest_layer_params']:,}):")
        for r in d["rows"]:
            print(f"  stage {r['stage']} offload_optimizer={r['offload_optimizer']!s:<5} "
                  f"offload_param={r['offload_param']!s:<5} per GPU {gb(r['gpu'])}  "
                  f"host {gb(r['host'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
