"""Pretrain a GPT model: parse the flags, build, train.

    torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --zero-stage 1 --num-layers 4 ... --train-iters 300

Megatron-LM flags plus ``--deepspeed_config ds.json``. With neither ``--data-path`` nor
``--mock-data`` it trains on the built-in demo corpus (see ``megazero/demo.py``).
``--log-json PATH`` additionally appends every logged iteration's metrics to PATH as JSON lines.
"""

from __future__ import annotations

import os
import sys


def split_entry_flags(argv: list[str]) -> tuple[list[str], str | None]:
    """Take out the flags this script handles itself (``--log-json PATH``)."""
    rest, log_json, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-json" and i + 1 < len(argv):
            log_json, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--log-json="):
            log_json = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return rest, log_json


def main(argv: list[str] | None = None) -> int:
    from megazero.arguments import load_config
    from megazero.config import ConfigError
    from megazero.training import pretrain

    argv = list(sys.argv[1:] if argv is None else argv)
    argv, log_json = split_entry_flags(argv)
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    try:
        cfg = load_config(argv, world_size)
    except ConfigError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    if "--log-interval" not in argv and cfg.deepspeed_config and "steps_per_print" in (
            cfg.ds_config or {}):
        from dataclasses import replace

        cfg = replace(cfg, logging=replace(cfg.logging,
                                           log_interval=cfg.logging.steps_per_print))
    from megazero.checkpointing import CheckpointError
    from megazero.initialize import destroy
    from megazero.training import TrainingDivergedError

    try:
        pretrain(cfg, log_json=log_json)
    except TrainingDivergedError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 3
    except (CheckpointError, ConfigError) as e:
        # Raised on every rank alike (a checkpoint saved at another layout, a config the
        # data or model rejects): a message, not a traceback per rank.
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
