"""The step-time model's MoE dispatch term against the dispatchers timed on 2 gloo ranks.

    PYTHONPATH=$PWD python bench/moe_dispatch_vs_model.py [--reps 15]

On 2 ranks (EP 2, one process each, gloo, 1 thread), for a few token counts and hidden sizes,
times one MoE layer's dispatcher alone (``dispatch`` + ``combine`` forward and backward, the
experts an identity, top-2 of 4 experts under a softmax over random logits) for both
dispatchers, and predicts it with :func:`megazero.planner.moe_cost.moe_dispatch_seconds` on
the ``cpu`` cluster description: as calibrated (no ``all_to_all`` entry: the all-to-all takes
the cluster's latency and link), and with an ``all_to_all`` alpha/beta fitted here on two
plain ``all_to_all_single`` sizes. The dispatcher's time also holds the permutation and
weighting work (index_select / index_add, the same rows at EP 1), which the model does not
put in this term; the communication measured is therefore the EP 2 time less the same
dispatcher's time on one rank (``comm``), and the ratios are taken on it. Prints a table
(medians over ``--reps`` with min-max) and writes ``bench/results/moe_dispatch_vs_model.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = [(256, 64), (1024, 256), (4096, 256)]  # (tokens per rank, hidden)
E, K = 4, 2


def _timed(fn, reps: int) -> list[float]:
    import torch.distributed as dist

    fn()  # warm-up
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _rank(rank: int, world: int, reps: int) -> dict:
    import torch.distributed as dist

    from megazero.moe.token_dispatcher import DISPATCHERS

    torch.manual_seed(rank)
    group = dist.new_group(list(range(world)))
    a2a = {}
    for nbytes in (1 << 16, 1 << 22):
        x = torch.zeros(nbytes // 4)
        y = torch.empty_like(x)
        a2a[nbytes] = _timed(lambda x=x, y=y: dist.all_to_all_single(y, x, group=group), reps)
    rows = []
    for tokens, hidden in SHAPES:
        for kind, cls in DISPATCHERS.items():
            x = torch.randn(tokens, hidden, requires_grad=True)
            scores = torch.randn(tokens, E).softmax(dim=-1)
            top = scores.topk(K, dim=-1).indices
            rmap = torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, top, True)
            probs = (scores * rmap).requires_grad_()
            local = E // world

            def step(x=x, probs=probs, rmap=rmap, cls=cls, local=local, ep=True) -> None:
                d = cls(E, rank * local, local, group) if ep else cls(E, 0, E, None)
                got, _ = d.dispatch(x, probs, rmap)
                d.combine(got).sum().backward()

            rows.append(dict(tokens=tokens, hidden=hidden, dispatcher=kind,
                             seconds=_timed(step, reps),
                             local=_timed(lambda step=step: step(ep=False), reps)))
    return {"a2a": a2a, "rows": rows}


def _fit(points: dict[int, list[float]]) -> list[float]:
    """[alpha us, GB/s of wire bytes] through two sizes' medians (wire: half the buffer)."""
    (n1, t1), (n2, t2) = sorted((n, statistics.median(t)) for n, t in points.items())
    beta = (n2 - n1) / 2 / max(1e-12, t2 - t1)
    return [max(0.0, t1 - n1 / 2 / beta) * 1e6, beta / 1e9]


def _predict(tokens: int, hidden: int, kind: str, cluster) -> float:
    from megazero.planner.moe_cost import moe_dispatch_seconds
    from megazero.planner.search import _config

    argv = (f"--num-layers 1 --hidden-size {hidden} --num-attention-heads 4 --seq-length "
            f"{tokens} --vocab-size 128 --tokenizer-type NullTokenizer --micro-batch-size 1 "
            f"--num-experts {E} --moe-router-topk {K} --disable-bias-linear").split()
    cfg = _config(argv, ["--expert-model-parallel-size", "2",
                         "--moe-token-dispatcher-type", kind], 2)
    return moe_dispatch_seconds(cfg, cluster)


def main() -> None:
    from megazero.planner.cluster import load_cluster
    from megazero.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    res = run_distributed(_rank, 2, args.reps, timeout=900)
    a2a = {n: res[0]["a2a"][n] + res[1]["a2a"][n] for n in res[0]["a2a"]}
    fitted = _fit(a2a)
    cpu = load_cluster("cpu")
    cpu_a2a = replace(cpu, collectives={**(cpu.collectives or {}), "all_to_all": fitted})
    table = []
    print(f"all_to_all fitted on 2 ranks: alpha {fitted[0]:.1f} us, {fitted[1]:.3f} GB/s")
    print(f"{'tokens':>7} {'hidden':>6} {'dispatcher':>10} {'EP 2 ms':>22} {'EP 1 ms':>8} "
          f"{'comm ms':>8} {'model ms':>9} {'ratio':>6} {'model+a2a ms':>12} {'ratio':>6}")
    for r0, r1 in zip(res[0]["rows"], res[1]["rows"]):
        times = [max(a, b) for a, b in zip(r0["seconds"], r1["seconds"])]  # the slower rank
        med = statistics.median(times)
        one = statistics.median(r0["local"] + r1["local"])
        comm = med - one
        p = _predict(r0["tokens"], r0["hidden"], r0["dispatcher"], cpu)
        pa = _predict(r0["tokens"], r0["hidden"], r0["dispatcher"], cpu_a2a)
        row = dict(tokens=r0["tokens"], hidden=r0["hidden"], dispatcher=r0["dispatcher"],
                   measured_median_s=med, measured_min_s=min(times), measured_max_s=max(times),
                   ep1_median_s=one, comm_s=comm,
                   predicted_s=p, predicted_with_fitted_a2a_s=pa)
        table.append(row)
        print(f"{row['tokens']:>7} {row['hidden']:>6} {row['dispatcher']:>10} "
              f"{med * 1e3:>8.2f} ({min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}) "
              f"{one * 1e3:>8.2f} {comm * 1e3:>8.2f} "
              f"{p * 1e3:>9.2f} {comm / p:>6.2f} {pa * 1e3:>12.2f} {comm / pa:>6.2f}")
    out = Path(__file__).resolve().parent / "results" / "moe_dispatch_vs_model.json"
    out.write_text(json.dumps({"reps": args.reps, "world": 2, "experts": E, "topk": K,
                               "all_to_all_fit": fitted, "rows": table}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
