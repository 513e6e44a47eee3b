"""Forward+backward time of one transformer layer: megazero's (tp=1) against plain PyTorch.

    python bench/layer_overhead.py [--seq 128] [--batch 4] [--hidden 256] [--heads 8] [--runs 20]

The plain layer is the same pre-norm GPT layer written with ``nn.LayerNorm``, ``nn.Linear``,
``F.scaled_dot_product_attention``, ``F.gelu`` and ``F.dropout`` in ``[b, s, h]``, loaded with the
same weights (outputs are checked equal with dropout off). megazero runs the SDPA backend in its
``[s, b, h]`` layout through the tensor-parallel code paths with a single rank (custom autograd
linear, RNG-tracker forks around dropout). Median of ``--runs`` timed iterations after warm-up,
the two layers alternating within each iteration; on CPU both thread CPU time (one intra-op
thread by default: robust on a loaded machine) and wall time.
Prints a table and writes ``bench/results/layer_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megazero.config import ModelConfig  # noqa: E402
from megazero.distributed.topology import ParallelTopology  # noqa: E402
from megazero.model.gpt import GPTModel  # noqa: E402
from megazero.tensor_parallel import ParallelContext  # noqa: E402


class PlainLayer(nn.Module):
    def __init__(self, h: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        d = h // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3 * d).transpose(1, 2)
        q, k, v = qkv.split(d, dim=-1)
        p = self.p if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)), p, self.training)
        m = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + F.dropout(m, p, self.training)


def copy_weights(plain: PlainLayer, ours: nn.Module) -> None:
    pairs = {
        "ln1": ours.input_layernorm, "ln2": ours.pre_mlp_layernorm,
        "qkv": ours.self_attention.linear_qkv, "proj": ours.self_attention.linear_proj,
        "fc1": ours.mlp.linear_fc1, "fc2": ours.mlp.linear_fc2,
    }
    with torch.no_grad():
        for name, src in pairs.items():
            dst = getattr(plain, name)
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)


def time_fwd_bwd(fns, xs, runs: int, warmup: int = 3) -> tuple[list[list[float]], ...]:
    """Per-function fwd+bwd wall and CPU times; the functions alternate within every
    iteration, so on a shared, loaded machine both see the same background load.

    On CPU with one intra-op thread, the thread's CPU time (``time.thread_time``) counts only
    the work done for this layer, not time spent descheduled by other processes: it is the
    robust number on a busy machine. On GPU only wall time (after synchronising) is meaningful.
    """
    sync = torch.cuda.synchronize if xs[0].is_cuda else (lambda: None)
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + runs):
        for k, (fn, x) in enumerate(zip(fns, xs)):
            xi = x.detach().requires_grad_()
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(xi).float().pow(2).mean().backward()
            sync()
            if i >= warmup:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.thread_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "layer_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    rows = []
    for p in (0.0, 0.1):
        cfg = ModelConfig.preset("gpt2", num_layers=1, hidden_size=h, num_attention_heads=a,
                                 seq_length=s, vocab_size=1000, attention_dropout=p,
                                 hidden_dropout=p, use_flash_attn=False)
        model = GPTModel(cfg, ParallelTopology.single(),
                         parallel=ParallelContext(attention_backend="sdpa"))
        ours = model.decoder.layers["0"].to(device=device, dtype=dtype)
        plain = PlainLayer(h, a, p)
        copy_weights(plain, ours)
        plain = plain.to(device=device, dtype=dtype)
        x = torch.randn(s, b, h, device=device, dtype=dtype)
        ours.eval()
        plain.eval()
        with torch.no_grad():
            diff = (ours(x).transpose(0, 1) - plain(x.transpose(0, 1))).abs().max().item()
        ours.train()
        plain.train()
        xb = x.transpose(0, 1).contiguous()
        wall, cpu = time_fwd_bwd([ours, plain], [x, xb], args.runs)
        row = dict(dropout=p, max_abs_output_diff_eval=diff)
        for clock, (t_ours, t_plain) in (("wall", wall), ("cpu", cpu)):
            med_o, med_p = statistics.median(t_ours), statistics.median(t_plain)
            row.update({f"megazero_{clock}_ms": med_o * 1e3, f"plain_{clock}_ms": med_p * 1e3,
                        f"{clock}_ratio": med_o / med_p})
        rows.append(row)
    print(f"one layer fwd+bwd, s={s} b={b} h={h} a={a}, {args.dtype} on {device} "
          f"({torch.get_num_threads()} threads), median of {args.runs}")
    clocks = ("wall",) if device.type == "cuda" else ("cpu", "wall")
    head = " ".join(f"{c + ' ' + k:>16}" for c in clocks for k in ("megazero", "plain", "ratio"))
    print(f"{'dropout':>7} {head} {'max|diff|':>10}")
    for r in rows:
        cells = " ".join(f"{r[f'megazero_{c}_ms']:>16.2f} {r[f'plain_{c}_ms']:>16.2f} "
                         f"{r[f'{c}_ratio']:>16.3f}" for c in clocks)
        print(f"{r['dropout']:>7} {cells} {r['max_abs_output_diff_eval']:>10.2e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {**vars(args), "threads": torch.get_num_threads(),
                              "machine": platform.machine(), "torch": torch.__version__},
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
