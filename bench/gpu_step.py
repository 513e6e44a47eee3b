"""Step time and MFU on one GPU: megazero (ZeRO 0-3, through ``pretrain_gpt.py``) against plain
PyTorch (eager and ``torch.compile``) training the same model in the same run.

    python bench/gpu_step.py                         # GPT 1.3B and Llama 1.5B, bf16, one GPU
    python bench/gpu_step.py --preset gpt --micro-batch-size 8 --stages 0
    python bench/gpu_step.py --tiny --device cpu     # a smoke run of every path on the CPU
    python bench/gpu_step.py --preset gpt --stages 0 --unfused   # the fusions on and off
    python bench/gpu_step.py --preset llama --stages 1 --fp8       # FP8 (tensorwise) vs bf16

The models (the issue's measurement): GPT 1.3B = 24 layers, h 2048, 16 heads, seq 2048, vocab
50304, GELU MLP 4h, learned positions, tied head; Llama 1.5B = 16 layers, h 2048, 32 heads in 8
KV groups, SwiGLU ffn 8192, RoPE, RMSNorm, vocab 128256, untied head. Every case trains
``micro-batch x accumulation`` sequences per iteration in bf16 with fp32 master weights and
AdamW; FLOPs are counted GEMM by GEMM
(:func:`megazero.observability.flops.gpt_flops_per_iteration`, the same count the training log
uses), so MFU is comparable between rows. Iteration time is the median over the iterations after
``--warmup``, with min and max beside it. Peak memory is ``torch.cuda.max_memory_allocated``.

The plain-PyTorch baseline is written here from the definitions, the way a user would write a
single-GPU loop: ``nn.Linear`` layers, ``F.scaled_dot_product_attention``, fused AdamW (on
CUDA), ``torch.autocast`` to bf16 over fp32 weights, gradient accumulation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.config import ModelConfig  # noqa: E402
from megazero.observability.flops import gpt_flops_per_iteration, peak_flops  # noqa: E402
from megazero.tensor_parallel import pad_vocab_size  # noqa: E402

PRESETS = {
    "gpt": dict(preset="gpt2", num_layers=24, hidden_size=2048, num_attention_heads=16,
                seq_length=2048, vocab_size=50304),
    "llama": dict(preset="llama", num_layers=16, hidden_size=2048, num_attention_heads=32,
                  num_query_groups=8, ffn_hidden_size=8192, seq_length=2048, vocab_size=128256),
}
TINY = dict(num_layers=2, hidden_size=64, seq_length=32, vocab_size=256)


def model_config(name: str, tiny: bool, seq_length: int | None = None) -> ModelConfig:
    spec = dict(PRESETS[name])
    preset = spec.pop("preset")
    if seq_length:  # a long-sequence run (--seq-length)
        spec.update(seq_length=seq_length)
    if tiny:
        spec.update(TINY, num_attention_heads=4)
        if "num_query_groups" in spec:
            spec.update(num_query_groups=2, ffn_hidden_size=128)
    return ModelConfig.preset(preset, attention_dropout=0.0, hidden_dropout=0.0, **spec)


# --- plain PyTorch -----------------------------------------------------------------------------

class PlainBlock(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        h, d = m.hidden_size, m.head_dim
        self.heads, self.groups, self.d = m.num_attention_heads, m.query_groups, d
        norm = nn.RMSNorm if m.normalization == "RMSNorm" else nn.LayerNorm
        bias = m.add_bias_linear
        self.norm1, self.norm2 = norm(h, eps=m.norm_epsilon), norm(h, eps=m.norm_epsilon)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.groups) * d, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.swiglu = m.swiglu
        self.fc1 = nn.Linear(h, m.ffn_size * (2 if m.swiglu else 1), bias=bias)
        self.fc2 = nn.Linear(m.ffn_size, h, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.groups, self.d).transpose(1, 2)
        v = v.view(b, s, self.groups, self.d).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = (t * cos + torch.cat([-t[..., self.d // 2:], t[..., :self.d // 2]], -1) * sin
                    for t in (q, k))
        if self.groups != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(ctx.transpose(1, 2).reshape(b, s, -1))
        h = self.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.fc2(h)


class PlainGPT(nn.Module):
    def __init__(self, m: ModelConfig, padded_vocab: int):
        super().__init__()
        self.m = m
        self.embed = nn.Embedding(padded_vocab, m.hidden_size)
        self.pos = (nn.Embedding(m.seq_length, m.hidden_size)
                    if m.position_embedding_type == "learned_absolute" else None)
        self.blocks = nn.ModuleList(PlainBlock(m) for _ in range(m.num_layers))
        norm = nn.RMSNorm if m.normalization == "RMSNorm" else nn.LayerNorm
        self.norm = norm(m.hidden_size, eps=m.norm_epsilon)
        self.head = (None if not m.untie_embeddings_and_output_weights
                     else nn.Linear(m.hidden_size, padded_vocab, bias=False))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        rope = None
        if self.pos is not None:
            x = x + self.pos.weight[:s]
        else:
            d = self.m.head_dim
            inv = self.m.rotary_base ** (-torch.arange(0, d, 2, device=x.device) / d)
            ang = torch.outer(torch.arange(s, device=x.device), inv)
            ang = torch.cat([ang, ang], -1)
            rope = (ang.cos().to(x.dtype), ang.sin().to(x.dtype))
        for block in self.blocks:
            x = block(x, rope)
        x = self.norm(x)
        logits = x @ (self.embed.weight if self.head is None else self.head.weight).t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def time_plain(m: ModelConfig, args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    padded = pad_vocab_size(m.vocab_size, 128, 1)
    model = PlainGPT(m, padded).to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **fused)
    step_model = torch.compile(model) if compiled else model
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (args.micro_batch_size, m.seq_length + 1),
                           generator=g).to(device)
    times = []
    _reset_peak(device)
    for _ in range(args.warmup + args.iters):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(args.grad_accum):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = step_model(tokens[:, :-1], tokens[:, 1:]) / args.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak_mb = _peak_mb(device)
    # Hand the memory back: the megazero cases run in other processes on the same GPU.
    del model, step_model, opt, loss
    if device.type == "cuda":
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return {"seconds": times[args.warmup:], "peak_mb": peak_mb}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


# --- megazero through pretrain_gpt.py ----------------------------------------------------------

def megazero_args(m: ModelConfig, name: str, args: argparse.Namespace, stage: int,
                  log_json: str) -> list[str]:
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             str(m.vocab_size), "--num-layers", str(m.num_layers), "--hidden-size",
             str(m.hidden_size), "--num-attention-heads", str(m.num_attention_heads),
             "--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.seq_length),
             "--attention-dropout", "0", "--hidden-dropout", "0",
             "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * args.grad_accum),
             "--lr", "1e-4", "--weight-decay", "0.1", "--clip-grad", "1.0",
             "--train-iters", str(args.warmup + args.iters), "--eval-iters", "0",
             "--log-interval", "1", "--log-json", log_json, "--zero-stage", str(stage)]
    if args.precision == "bf16":
        flags.append("--bf16")
    if PRESETS[name]["preset"] == "llama":
        flags += ["--model-preset", "llama", "--num-query-groups", str(m.query_groups),
                  "--group-query-attention", "--ffn-hidden-size", str(m.ffn_size)]
    if args.device == "cpu":
        flags += ["--distributed-backend", "gloo"]
    return flags


#: Megatron's switches of the elementwise fusions (megazero.fusions); the "unfused" case
#: turns them all off to measure what they gain.
NO_FUSIONS = ["--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
              "--no-rope-fusion"]


def fp8_flags(recipe: str) -> list[str]:
    """Megatron's FP8 flags for one recipe: e4m3 inputs and weights, e5m2 gradients."""
    return ["--fp8-format", "hybrid", "--fp8-recipe", recipe]


def time_megazero(m: ModelConfig, name: str, args: argparse.Namespace, stage: int,
                  profile: bool = False, extra: list[str] | None = None) -> dict[str, Any]:
    """``profile``: also profile the last iteration (``--profile --use-pytorch-profiler``) and
    return the table of top kernels; that iteration is then left out of the timings.
    ``extra``: more flags (:data:`NO_FUSIONS`)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
               *megazero_args(m, name, args, stage, log), *(extra or [])]
        last = args.warmup + args.iters
        if profile:
            cmd += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(last),
                    "--profile-step-end", str(last + 1)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"megazero ZeRO-{stage} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(log, encoding="utf-8")]
    its = [r for r in rows if "iteration-time" in r and r["iteration"] > args.warmup
           and not (profile and r["iteration"] == last)]
    peak = [r["memory_mb"] for r in its if r.get("memory_mb") is not None]
    banner = [line for line in proc.stdout.splitlines() if line.startswith("> attention")]
    fusions = [line for line in proc.stdout.splitlines() if line.startswith("> fusions")]
    fp8 = [line for line in proc.stdout.splitlines() if line.startswith("> fp8")]
    out: dict[str, Any] = {"seconds": [r["iteration-time"] for r in its],
                           "peak_mb": max(peak) if peak else None,
                           "attention": banner[0][2:] if banner else None,
                           "fusions": fusions[0][2:] if fusions else None,
                           "fp8": fp8[0][2:] if fp8 else None}
    if profile:
        start = proc.stdout.find("profile of iterations")
        out["profile"] = proc.stdout[start:] if start >= 0 else None
    return out


# --- report ------------------------------------------------------------------------------------

def summarise(case: str, model: str, res: dict[str, Any], flops: float, tokens: int,
              peak: float | None) -> dict[str, Any]:
    sec = res["seconds"]
    med = statistics.median(sec)
    return {"model": model, "case": case, "ms_median": 1000 * med, "ms_min": 1000 * min(sec),
            "ms_max": 1000 * max(sec), "tokens_per_s": tokens / med,
            "tflops": flops / med / 1e12, "mfu": flops / med / peak if peak else None,
            "peak_mb": res["peak_mb"], "iterations": len(sec)}


def _write(out: str, env: dict[str, Any], args: argparse.Namespace, peak: float | None,
           rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump({**env, "precision": args.precision, "micro_batch_size": args.micro_batch_size,
                   "grad_accum": args.grad_accum, "peak_flops": peak, "rows": rows}, f, indent=1)
    os.replace(out + ".tmp", out)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", choices=("gpt", "llama", "both"), default="both")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--iters", type=int, default=17, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    ap.add_argument("--stages", default="0,1,2,3", help="megazero ZeRO stages to time")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-eager", action="store_true", help="skip the plain eager baseline")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke test of the paths)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more iteration of the first megazero stage and keep the "
                         "table of its top kernels")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    ap.add_argument("--unfused", action="store_true",
                    help="also time the first megazero stage with every elementwise fusion off "
                         "(" + " ".join(NO_FUSIONS) + "): what the fusions gain")
    ap.add_argument("--fp8", nargs="?", const="tensorwise", default=None,
                    choices=("tensorwise", "delayed", "blockwise"),
                    help="also time each ZeRO stage with FP8 GEMMs (--fp8-format hybrid and "
                         "this --fp8-recipe), beside the bf16 case: FP8 vs bf16 tokens/s")
    ap.add_argument("--seq-length", type=int, default=None,
                    help="sequence length instead of the presets' 2048 (a long-context run)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(dev_name, args.precision == "bf16") if device.type == "cuda" else None
    flash = None
    try:
        import flash_attn
        flash = flash_attn.__version__
    except ImportError:
        pass
    env = {"device": dev_name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "capability": (".".join(map(str, torch.cuda.get_device_capability(device)))
                          if device.type == "cuda" else None), "flash_attn": flash}
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    out = args.out or os.path.join(
        ROOT, "bench", "results",
        f"gpu_step_{dev_name.replace(' ', '_').replace('/', '_')}{'_tiny' if args.tiny else ''}"
        ".json")
    rows: list[dict[str, Any]] = []
    names = ("gpt", "llama") if args.preset == "both" else (args.preset,)
    for name in names:
        m = model_config(name, args.tiny, args.seq_length)
        gbs = args.micro_batch_size * args.grad_accum
        flops = gpt_flops_per_iteration(m, gbs, pad_vocab_size(m.vocab_size, 128, 1))
        tokens = gbs * m.seq_length
        cases = [] if args.no_eager else [
            ("plain eager", lambda m=m: time_plain(m, args, compiled=False))]
        for i, stage in enumerate(int(s) for s in args.stages.split(",") if s):
            cases.append((f"megazero ZeRO-{stage}",
                          lambda m=m, stage=stage, name=name, i=i: time_megazero(
                              m, name, args, stage, profile=args.profile and i == 0)))
            if args.fp8:
                cases.append((f"megazero ZeRO-{stage} fp8 {args.fp8}",
                              lambda m=m, stage=stage, name=name: time_megazero(
                                  m, name, args, stage, extra=fp8_flags(args.fp8))))
            if args.unfused and i == 0:
                cases.append((f"megazero ZeRO-{stage} unfused",
                              lambda m=m, stage=stage, name=name: time_megazero(
                                  m, name, args, stage, extra=NO_FUSIONS)))
        if not args.no_compile:  # last: the slowest to start
            cases.append(("plain compiled", lambda m=m: time_plain(m, args, compiled=True)))
        for case, run in cases:
            try:
                res = run()
            except Exception as e:  # one failing case must not lose the others' rows
                print(f"{name:6} {case:26} FAILED: {str(e)[-2000:]}", flush=True)
                rows.append({"model": name, "case": case, "error": str(e)[-4000:],
                             "ms_median": float("nan")})
                _write(out, env, args, peak, rows)
                continue
            row = summarise(case, name, res, flops, tokens, peak)
            for key in ("attention", "fusions", "fp8", "profile"):
                if res.get(key):
                    row[key] = res[key]
            rows.append(row)
            mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
            mem = f"{row['peak_mb']:.0f}" if row["peak_mb"] is not None else "n/a"
            print(f"{name:6} {case:26} {row['ms_median']:9.1f} ms "
                  f"[{row['ms_min']:.1f}, {row['ms_max']:.1f}]  {row['tokens_per_s']:10.0f} "
                  f"tok/s  {row['tflops']:7.1f} TFLOP/s  MFU {mfu:>6}  peak {mem} MB",
                  flush=True)
            if row.get("profile"):
                print(row["profile"], flush=True)
            _write(out, env, args, peak, rows)  # after every row: a cut-off run keeps them
    print(f"wrote {out}")
    if any(math.isnan(r["ms_median"]) for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
