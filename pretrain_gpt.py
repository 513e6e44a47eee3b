"""Pretrain a GPT model: parse the flags, build, train.

    torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --zero-stage 1 --num-layers 4 ... --train-iters 300

Megatron-LM flags plus ``--deepspeed_config ds.json`` (``--help`` lists them). With neither
``--data-path`` nor ``--mock-data`` it trains on the built-in demo corpus (see
``megazero/data/demo.py``). ``--log-json PATH`` additionally appends every logged iteration's
metrics to PATH as JSON lines.

Errors megazero raises on purpose (a wrong flag, a missing file, a checkpoint of another model, an
fp16 run that overflows at the minimum loss scale) print one ``pretrain_gpt.py: error: ...`` line
per job and exit with status 2; ``MEGAZERO_DEBUG=1`` adds the tracebacks (see
:mod:`megazero.errors`).
"""

from __future__ import annotations

import os
import sys
import warnings

PROG = "pretrain_gpt.py"


def main(argv: list[str] | None = None) -> int:
    from megazero.errors import (
        already_reported,
        debug_enabled,
        env_rank,
        expected_errors,
        one_line_warnings,
        report_error,
    )

    argv = list(sys.argv[1:] if argv is None else argv)
    from megazero.distributed.device import adopt_local_rank_argument

    adopt_local_rank_argument(argv, os.environ)  # DeepSpeed's launcher: --local_rank=N
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    one_line_warnings(PROG)
    try:
        from megazero.config import load_config

        # Every rank reads the same flags and JSON: rank 0 alone speaks about them.
        with warnings.catch_warnings():
            if env_rank() != 0:
                warnings.simplefilter("ignore")
            cfg = load_config(argv, world_size)
    except expected_errors() as e:
        return report_error(e, PROG)

    from megazero.distributed.startup import destroy
    from megazero.training.healing import record_failure
    from megazero.training.pretrain import pretrain

    try:
        pretrain(cfg)
    except expected_errors() as e:
        # the next attempt of a job under torchrun --max-restarts says what ended this one
        return report_error(e, PROG, on_report=lambda message: record_failure(
            cfg.checkpoint.save, env_rank(), message))
    except Exception:
        if already_reported() and not debug_enabled():
            return 0  # a peer stopped the job and said why; this is the consequence
        raise
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
