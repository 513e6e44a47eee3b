"""The one-rank run the training rows compare with: ``python -m megazero.cluster_check.
reference --out F --iters N --world W --precisions fp32,...`` trains the rows' GPT in a world of
one (no launcher variables; :mod:`megazero.distributed.startup`) with the same global batch as ``W``
ranks, by gradient accumulation, and writes ``{precision: {iteration: loss}}`` to ``F``."""

from __future__ import annotations

import argparse
import json

from megazero.cluster_check.training_rows import MICRO, PRECISION_FLAGS, TINY_GPT, train_losses
from megazero.distributed.startup import destroy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--precisions", default="fp32")
    a = p.parse_args(argv)
    out = {}
    for precision in a.precisions.split(","):
        args = [*TINY_GPT, "--global-batch-size", str(MICRO * a.world), "--zero-stage", "0",
                "--distributed-backend", a.backend, *PRECISION_FLAGS[precision],
                "--train-iters", str(a.iters)]
        out[precision], _ = train_losses(args)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f)
    destroy(orderly=True)  # a world of one: nobody to wait for
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
