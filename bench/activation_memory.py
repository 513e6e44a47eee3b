"""Activation bytes per transformer layer: measured (what autograd saves) vs Megatron's formulas.

    python bench/activation_memory.py [--seq 128] [--batch 2] [--hidden 256] [--heads 8] [--tp 4]

A gpt2-preset layer (LayerNorm, GELU, biases, dropout 0.1, unfused core attention) in bf16 on
``--tp`` gloo ranks, for no TP, TP, TP+SP and TP+SP+selective recomputation; then the same with
SDPA as the core attention, for comparison (the formulas describe the unfused attention; on CPU,
SDPA with dropout runs an fp32 math path that saves more, without dropout a fused kernel that
saves no ``s^2`` term at all). Prints the tables and writes
``bench/results/activation_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.testing import run_distributed  # noqa: E402
from megazero.testing.activation_memory import measure_layer_cases  # noqa: E402

FORMULAS = {
    "no TP": "sbh(34 + 5as/h)",
    "TP": "sbh(10 + 24/t + 5as/(ht))",
    "TP+SP": "sbh(34 + 5as/h)/t",
    "TP+SP+selective": "34sbh/t",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tp", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for backend, p_attn in (("unfused", 0.1), ("sdpa", 0.1), ("sdpa", 0.0)):
        part = run_distributed(measure_layer_cases, args.tp, args.seq, args.batch, args.hidden,
                               args.heads, args.tp, backend, p_attn, timeout=600)[0]
        print(f"\n{backend} core attention: s={args.seq} b={args.batch} h={args.hidden} "
              f"a={args.heads} t={args.tp}, bf16, hidden dropout 0.1, attention dropout "
              f"{p_attn}, bytes per layer")
        print(f"{'case':<17} {'formula':<26} {'measured':>10} {'formula':>10} {'ratio':>7}")
        for r in part:
            r["formula"] = FORMULAS[r["case"]]
            print(f"{r['case']:<17} {r['formula']:<26} {r['measured_bytes']:>10} "
                  f"{r['formula_bytes']:>10.0f} {r['ratio']:>7.4f}")
        rows += part
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "activation_memory.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
