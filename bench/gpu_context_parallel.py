"""Ring attention's kernels and merge on one GPU, against full causal attention.

    python bench/gpu_context_parallel.py [--seq 8192] [--heads 16] [--groups 4] [--out PATH]

One GPU holds one rank, so the CP ranks are emulated in one process
(:func:`megazero.testing.cp_emulate.emulate_ring`: the ring's own step functions, each rank
handed the K/V block the ring delivers); the transfers are tested on gloo in CI. For CP 2 and
4, bf16 and fp32 inputs, the kernels the ring picks (flash-attention where flash-attn is
installed, else the pure-PyTorch fp32 blocks): the largest error of the output and of
dQ/dK/dV against fp32 autograd through full causal attention, relative to the largest
reference value, beside the same error of PyTorch's own bf16 SDPA on the whole sequence (what
a bf16 run accepts anyway). Writes ``bench/results/gpu_context_parallel_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.context_parallel import blockwise, flash  # noqa: E402
from megazero.testing.cp_emulate import emulate_ring, full_causal_reference  # noqa: E402


def _errors(got, ref) -> list[float]:
    return [((g.float() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref)]


def _sdpa(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2])
    out = out.permute(2, 0, 1, 3)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (args.seq, args.batch)
    q32 = torch.randn(*shape, args.heads, args.head_dim, device=dev, generator=g)
    k32 = torch.randn(*shape, args.groups, args.head_dim, device=dev, generator=g)
    v32 = torch.randn(*shape, args.groups, args.head_dim, device=dev, generator=g)
    do32 = torch.randn(*shape, args.heads, args.head_dim, device=dev, generator=g)
    ref = full_causal_reference(q32, k32, v32, do32)
    rows = []
    names = ("out", "dq", "dk", "dv")
    print(f"{name}, torch {torch.__version__}, flash-attn "
          f"{'installed' if flash._fa is not None else 'not installed'}; s={args.seq} "
          f"heads={args.heads} groups={args.groups} d={args.head_dim}; max|err|/max|ref|")
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, do = (t.to(dtype) for t in (q32, k32, v32, do32))
        base = _errors(_sdpa(q, k, v, do), ref)
        rows.append({"case": "sdpa whole sequence", "dtype": str(dtype), "cp": 1,
                     **dict(zip(names, base))})
        kern = blockwise.kernels_for(q)
        which = "flash" if kern.forward is flash.block_forward else "pure fp32 blocks"
        for cp in (2, 4):
            torch.cuda.synchronize()
            err = _errors(emulate_ring(q, k, v, do, cp), ref)
            rows.append({"case": f"ring ({which})", "dtype": str(dtype), "cp": cp,
                         **dict(zip(names, err))})
        for r in rows[-3:]:
            print(f"{r['case']:<24} {r['dtype']:<15} cp={r['cp']}  "
                  + "  ".join(f"{n} {r[n]:.2e}" for n in names))
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"gpu_context_parallel_{name.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"device": name, "torch": torch.__version__, "config": vars(args),
                   "flash_attn": flash._fa is not None, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
