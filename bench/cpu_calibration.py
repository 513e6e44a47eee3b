"""Micro-benchmarks that calibrate the ``cpu`` cluster description (gloo ranks on this machine).

Two gloo ranks, one thread each, run every benchmark at the same time (as the ranks of a
training run share the machine's cores):

* GEMM rate: ``torch.mm`` at the shapes of the benchmark model's layers (full and halved by
  tensor parallelism), FLOP/s per rank -> ``peak_tflops_32``;
* solo speedup: the GEMM rate of rank 0 while rank 1 waits, over its rate while both compute
  -> ``solo_speedup`` (the ranks share the machine's cores and memory bandwidth);
* per-layer overhead: forward + backward of a GPTModel with hidden size 16 (nearly no
  arithmetic) at 1 and 5 layers: the slope per layer / 3 is ``per_layer_overhead_us`` (the
  step-time model charges it per pass over a layer: forward and the two halves of backward);
* per-micro-batch overhead: a full-size 1-layer model at micro-batch 1 and 4, ``t(b) = c + b k``:
  ``c`` less the 3 layer passes is ``per_microbatch_overhead_us`` (embedding, loss, glue, and
  the slower rows of small GEMMs);
* achievable fraction: forward + backward of full-size transformer layers (hidden 256, seq
  128, micro-batch 4; 3 layers minus 1 layer, halved): their GEMM FLOPs / (time - layer
  overhead) / GEMM rate = f; ``nongemm_share`` = 1/f - 1 (the softmax, norms and element-wise
  work beside the GEMMs), ``achievable_fraction`` 1;
* gloo collectives: all-reduce, all-gather, reduce-scatter and send/recv at 4 KiB-16 MiB;
  a line per kind ``t = alpha + bytes_on_the_wire / beta`` through 4 KiB and 16 MiB (ring
  bytes: 2(n-1)/n of the buffer for all-reduce, (n-1)/n for the others)
  -> ``per_collective_latency_us`` (alpha) and ``intra_node_gbps`` (beta), and every
  kind's line -> ``collectives``;
* AdamW: a torch AdamW step on a flat 2M-element fp32 shard -> ``device_adam_gparams_per_s``
  and ``cpu_adam_gparams_per_s`` (the host is the device); ``comm_overlaps_compute`` is false
  (gloo's copies and reductions need the cores the ranks compute on).

None of these runs a layout of bench/estimator_vs_measured.py. Prints the table and writes
bench/results/cpu_calibration.json; ``--write-cluster`` also writes the constants into
megazero/planner/clusters/cpu.json.

    PYTHONPATH=$PWD python bench/cpu_calibration.py [--write-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = [4 << 10, 64 << 10, 512 << 10, 4 << 20, 16 << 20]
H, S, B, FFN = 256, 128, 4, 1024


def _timed(fn, reps: int) -> float:
    """Mean seconds of ``reps`` calls after two warm-up calls. The mean, not the median: on a
    shared machine a call now and then waits a scheduler tick (~4 ms) for a descheduled peer,
    and a run's time is the sum of its calls, ticks included."""
    fn()
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.mean(out)


def _gemm_rate() -> dict:
    import torch

    rows = []
    for tp in (1, 2):
        t = S * B
        for k, n in ((H, 3 * H // tp), (H // tp, H), (H, FFN // tp), (FFN // tp, H)):
            a, b = torch.randn(t, k), torch.randn(k, n)
            sec = _timed(lambda a=a, b=b: torch.mm(a, b), 20)
            rows.append({"m": t, "k": k, "n": n, "flops": 2 * t * k * n, "s": sec,
                         "gflops": 2 * t * k * n / sec / 1e9})
    # the rate of the layer's GEMMs together: total FLOPs over total time
    return {"shapes": rows, "gflops": sum(r["flops"] for r in rows) / sum(r["s"] for r in rows)
            / 1e9}


def _model(hidden: int, layers: int, seq: int):
    from megazero.config import ModelConfig
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    mc = ModelConfig.preset("gpt2", num_layers=layers, hidden_size=hidden,
                            num_attention_heads=8 if hidden >= 64 else 2, seq_length=seq,
                            max_position_embeddings=seq, vocab_size=1024,
                            ffn_hidden_size=4 * hidden)
    return GPTModel(mc, ParallelTopology.single())


def _fwd_bwd_seconds(hidden: int, layers: int, seq: int, batch: int, reps: int) -> float:
    import torch

    model = _model(hidden, layers, seq)
    tokens = torch.randint(0, 1024, (batch, seq))

    def step():
        model(tokens, tokens).mean().backward()

    return _timed(step, reps)


def _overheads(gemm_gflops: float) -> dict:
    t1 = _fwd_bwd_seconds(16, 1, 8, 1, 30)
    t5 = _fwd_bwd_seconds(16, 5, 8, 1, 30)
    per_layer_pass = (t5 - t1) / 4 / 3
    # a micro-batch's fixed part at full size: t(b) = c + b k from micro-batches 1 and 4 of a
    # 1-layer model (small GEMMs run slower per row; embedding, loss and glue), less the layer
    # passes charged apart
    b1 = _fwd_bwd_seconds(H, 1, S, 1, 15)
    b4 = _fwd_bwd_seconds(H, 1, S, 4, 9)
    per_mb = (4 * b1 - b4) / 3 - 3 * per_layer_pass
    # full-size layers: (3 layers - 1 layer) / 2 isolates one from embedding and logits
    f1 = _fwd_bwd_seconds(H, 1, S, B, 9)
    f3 = _fwd_bwd_seconds(H, 3, S, B, 9)
    layer = (f3 - f1) / 2
    gemm = 3 * S * B * 2 * (4 * H * H + 2 * H * FFN + 2 * S * H)
    fraction = gemm / (gemm_gflops * 1e9) / max(1e-9, layer - 3 * per_layer_pass)
    return {"tiny_1_layer_s": t1, "tiny_5_layers_s": t5, "per_layer_pass_s": per_layer_pass,
            "one_layer_mbs1_s": b1, "one_layer_mbs4_s": b4,
            "per_microbatch_s": per_mb, "full_layer_fwd_bwd_s": layer,
            "full_layer_gemm_flops": gemm, "achievable_fraction": fraction}


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``t = alpha + x / beta`` through the smallest and the largest buffer: (alpha seconds,
    beta bytes/s). Two points, not least squares: a descheduled peer adds a scheduler tick
    (~4 ms) to some calls of any size, which would tilt a fitted line through them all."""
    (x0, y0), (x1, y1) = min(points), max(points)
    beta = (x1 - x0) / max(1e-9, y1 - y0)
    return max(0.0, y0 - x0 / beta), beta


def _collectives(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    out: dict[str, list] = {"all_reduce": [], "all_gather": [], "reduce_scatter": [],
                            "send_recv": []}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        part = torch.empty(x.numel() // world)

        def p2p(x=x):
            if rank == 0:
                dist.send(x, 1)
            else:
                dist.recv(x, 0)

        calls = {"all_reduce": lambda x=x: dist.all_reduce(x),
                 "all_gather": lambda x=x, p=part: dist.all_gather_into_tensor(x, p),
                 "reduce_scatter": lambda x=x, p=part: dist.reduce_scatter_tensor(p, x),
                 "send_recv": p2p}
        reps = 20 if nbytes <= 512 << 10 else 6
        for kind, fn in calls.items():
            dist.barrier()
            wire = nbytes * (2 if kind == "all_reduce" else 1) * (
                (world - 1) / world if kind != "send_recv" else 1)
            out[kind].append({"bytes": nbytes, "wire_bytes": wire, "s": _timed(fn, reps)})
    fits = {}
    for kind, rows in out.items():
        alpha, beta = _fit([(r["wire_bytes"], r["s"]) for r in rows])
        fits[kind] = {"alpha_us": alpha * 1e6, "beta_gbps": beta / 1e9}
    return {"points": out, "fits": fits}


def _adam_rate(numel: int = 1 << 21) -> float:
    """Parameters per second of a torch AdamW step on one flat fp32 shard (the ZeRO engine's
    local optimizer)."""
    import torch

    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return numel / _timed(opt.step, 10)


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    gemm = _gemm_rate()
    dist.barrier()
    solo = _gemm_rate() if rank == 0 else None  # the other rank waits in the barrier
    dist.barrier()
    if solo is not None:
        gemm["solo_gflops"] = solo["gflops"]
    over = _overheads(gemm["gflops"])
    coll = _collectives(rank, world)
    return {"gemm": gemm, "overheads": over, "collectives": coll, "adam_params_per_s": _adam_rate()}


def _constants(res: list[dict]) -> dict:
    r0 = res[0]
    gflops = statistics.mean(r["gemm"]["gflops"] for r in res)
    over = {k: statistics.mean(r["overheads"][k] for r in res) for k in r0["overheads"]}
    fits = r0["collectives"]["fits"]
    adam = statistics.mean(r["adam_params_per_s"] for r in res)
    ar = fits["all_reduce"]
    solo = r0["gemm"]["solo_gflops"] / r0["gemm"]["gflops"]
    return {"solo_speedup": round(max(1.0, solo), 3),
            "nongemm_share": round(max(0.0, 1 / over["achievable_fraction"] - 1), 3),
            "peak_tflops_32": round(gflops / 1e3, 5),
            "achievable_fraction": 1.0,  # the rest is nongemm_share
            "per_layer_overhead_us": round(over["per_layer_pass_s"] * 1e6, 1),
            "per_microbatch_overhead_us": round(max(0.0, over["per_microbatch_s"]) * 1e6, 1),
            "per_collective_latency_us": round(ar["alpha_us"], 1),
            "intra_node_gbps": round(ar["beta_gbps"], 3),
            "inter_node_gbps": round(ar["beta_gbps"], 3),
            "comm_overlaps_compute": False,
            "device_adam_gparams_per_s": round(adam / 1e9, 5),
            "cpu_adam_gparams_per_s": round(adam / 1e9, 5),
            "collectives": {k: [round(f["alpha_us"], 1), round(f["beta_gbps"], 3)]
                            for k, f in fits.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-cluster", action="store_true",
                    help="write the constants into megazero/planner/clusters/cpu.json")
    ap.add_argument("--repeats", type=int, default=3, help="calibration runs; medians are kept")
    args = ap.parse_args()
    from megazero.testing import run_distributed

    load = os.getloadavg()[0]
    runs = []
    for _ in range(args.repeats):  # the shared machine's load comes and goes: medians of runs
        res = run_distributed(_rank, 2, timeout=900)
        runs.append({"ranks": res, "constants": _constants(res)})
        print(json.dumps(runs[-1]["constants"]), flush=True)
    constants = {k: (statistics.median(r["constants"][k] for r in runs)
                     if isinstance(v, float) else v) for k, v in runs[0]["constants"].items()}
    constants["collectives"] = {
        kind: [statistics.median(r["constants"]["collectives"][kind][i] for r in runs)
               for i in range(2)] for kind in runs[0]["constants"]["collectives"]}
    print("median of", args.repeats, "runs:", json.dumps(constants))
    path = Path(__file__).parent / "results" / "cpu_calibration.json"
    path.write_text(json.dumps({"load_before": load, "load_after": os.getloadavg()[0],
                                "runs": runs, "constants": constants},
                               indent=1) + "\n")
    if args.write_cluster:
        cpath = Path(__file__).resolve().parent.parent / "megazero/planner/clusters/cpu.json"
        data = json.loads(cpath.read_text())
        data.update(constants)
        cpath.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
