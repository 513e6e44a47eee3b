"""Init time and peak host memory of one rank's parameter shards at tp 1, 2, 4, 8.

One GPT model (hidden 1024, 8 layers, vocab 32000, seq 1024, LayerNorm, GELU, biases) is
described by its parameters' global names, shard shapes and partition metadata; for each tp a
fresh process allocates the last TP rank's shards and initialises them, the way
``GPTModel`` does (no process groups needed: the rank and size are passed explicitly). Two
methods are measured:

* ``shard``: :func:`megazero.model.init.init_parameter_` (computes only the shard's elements);
* ``full``: the previous scheme, drawing the full fp32 tensor with a per-name generator and
  keeping the slice.

Peak memory is the rise of the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) over its RSS before allocating, compared with the shard's bytes.

    PYTHONPATH=$PWD python bench/init_scaling.py   # prints a table, writes
                                                   # bench/results/init_scaling.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, LAYERS, VOCAB, SEQ, DIVISIBLE = 1024, 8, 32000, 1024, 128
TPS = (1, 2, 4, 8)
ROUNDS = 3


def model_params(tp: int) -> list[tuple[str, tuple[int, ...], int | None, int, int | None]]:
    """``(global name, shard shape, partition_dim, stride, vocab_size)`` of one TP rank."""
    h, ffn = HIDDEN, 4 * HIDDEN
    padded = -(-VOCAB // (DIVISIBLE * tp)) * DIVISIBLE * tp
    out = [("embedding.word_embeddings.weight", (padded // tp, h), 0, 1, VOCAB),
           ("embedding.position_embeddings.weight", (SEQ, h), None, 1, None)]
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), None, 1, None),
            (p + "input_layernorm.bias", (h,), None, 1, None),
            (p + "self_attention.linear_qkv.weight", (3 * h // tp, h), 0, 1, None),
            (p + "self_attention.linear_qkv.bias", (3 * h // tp,), 0, 1, None),
            (p + "self_attention.linear_proj.weight", (h, h // tp), 1, 1, None),
            (p + "self_attention.linear_proj.bias", (h,), None, 1, None),
            (p + "pre_mlp_layernorm.weight", (h,), None, 1, None),
            (p + "pre_mlp_layernorm.bias", (h,), None, 1, None),
            (p + "mlp.linear_fc1.weight", (ffn // tp, h), 0, 1, None),
            (p + "mlp.linear_fc1.bias", (ffn // tp,), 0, 1, None),
            (p + "mlp.linear_fc2.weight", (h, ffn // tp), 1, 1, None),
            (p + "mlp.linear_fc2.bias", (h,), None, 1, None),
        ]
    out += [("decoder.final_layernorm.weight", (h,), None, 1, None),
            ("decoder.final_layernorm.bias", (h,), None, 1, None)]
    return out


def spec(name: str):
    """The rule GPTModel's layers declare for ``name`` (megazero.model.init.InitSpec)."""
    from megazero.model.init import InitSpec

    if "layernorm" in name:
        return InitSpec("ones" if name.endswith("weight") else "zeros", key=name)
    if name.endswith("bias"):
        return InitSpec("zeros", key=name)
    return InitSpec("normal", name.endswith(("linear_proj.weight", "linear_fc2.weight")), name)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def child(tp: int, method: str) -> dict:
    import torch

    from megazero.config import ModelConfig
    from megazero.model import init as mi
    from megazero.tensor_parallel.layers import (
        mark_vocab_parallel,
        set_tensor_model_parallel_attributes,
    )
    from megazero.tensor_parallel.utils import shard_tensor

    torch.set_num_threads(1)
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=16,
                      vocab_size=VOCAB, seq_length=SEQ)
    rank, seed = tp - 1, 1234
    mi.init_parameter_(torch.empty(4, 4), mi.InitSpec(key="w"), cfg, seed)  # load kernels
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    shard_bytes = 0
    params = []
    held = mi.workspace()  # as GPTModel's initialize_parameters holds it for the whole model
    held.__enter__()
    for name, shape, dim, stride, vocab in model_params(tp):
        p = torch.nn.Parameter(torch.empty(shape))
        if vocab is not None:
            mark_vocab_parallel(p, vocab, shape[0] * tp)
        elif dim is not None:
            set_tensor_model_parallel_attributes(p, dim, stride)
        if method == "shard":
            mi.init_parameter_(p, spec(name), cfg, seed, rank, tp)
        else:  # the previous scheme: the full tensor on every rank, keep the slice
            full = torch.empty(mi.full_shape(p, tp))
            if spec(name).kind == "normal":
                gen = torch.Generator().manual_seed(mi.param_seed(seed, name))
                full.normal_(0.0, spec(name).std(cfg), generator=gen)
            if vocab is not None:
                pad = torch.cat([full, full.new_zeros(shape[0] * tp - vocab, shape[1])])
                p.data.copy_(pad.chunk(tp)[rank])
            elif dim is not None:
                p.data.copy_(shard_tensor(full, dim, stride, rank, tp))
            else:
                p.data.copy_(full)
            del full
        shard_bytes += p.numel() * p.element_size()
        params.append(p)
    held.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    peak = (_rss_kib("VmHWM") - base) * 1024
    return {"tp": tp, "method": method, "rank": rank, "init_s": seconds,
            "shard_mib": shard_bytes / 2**20, "peak_extra_mib": peak / 2**20,
            "peak_over_shard": peak / shard_bytes}


def main() -> None:
    rows = []
    for method in ("shard", "full"):
        for tp in TPS:
            rounds = []
            for _ in range(ROUNDS):  # a shared machine: time is the best round, memory the worst
                out = subprocess.run([sys.executable, __file__, "--child", str(tp), method],
                                     check=True, capture_output=True, text=True).stdout
                rounds.append(json.loads(out.strip().splitlines()[-1]))
            row = min(rounds, key=lambda r: r["init_s"])
            worst = max(rounds, key=lambda r: r["peak_extra_mib"])
            row.update(peak_extra_mib=worst["peak_extra_mib"],
                       peak_over_shard=worst["peak_over_shard"], rounds=ROUNDS)
            rows.append(row)
    print(f"{'method':>6} {'tp':>3} {'init s':>8} {'shard MiB':>10} {'peak MiB':>9} "
          f"{'peak/shard':>10}")
    for r in rows:
        print(f"{r['method']:>6} {r['tp']:>3} {r['init_s']:8.2f} {r['shard_mib']:10.1f} "
              f"{r['peak_extra_mib']:9.1f} {r['peak_over_shard']:10.2f}")
    by = {(r["method"], r["tp"]): r for r in rows}
    summary = {m: by[(m, 1)]["init_s"] / by[(m, 8)]["init_s"] for m in ("shard", "full")}
    print("tp1/tp8 init-time ratio:", {k: round(v, 2) for k, v in summary.items()})
    path = Path(__file__).parent / "results" / "init_scaling.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": {"hidden": HIDDEN, "layers": LAYERS, "vocab": VOCAB,
                                          "seq": SEQ}, "threads": 1, "rows": rows,
                                "tp1_over_tp8_time": summary}, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), sys.argv[3])))
    else:
        main()
