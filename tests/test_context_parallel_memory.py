"""Context parallelism divides activation memory by CP, and the planner predicts it.

One world of 4 gloo ranks measures, as the pipeline's activation meter counts it, the bytes one
micro-batch's forward keeps for backward through a 2-layer GPT at a fixed sequence (256) at CP
1, 2 and 4 (:mod:`megazero.testing.context_parallel_memory`); the planner's activation model
(:mod:`megazero.planner.activations`) predicts each.
"""

from __future__ import annotations

import pytest

from megazero.config import load_config
from megazero.planner.cluster import load_cluster
from megazero.planner.cp_cost import kv_traffic_bytes
from megazero.planner.step_time import step_time
from megazero.testing import run_distributed
from megazero.testing.context_parallel_memory import measure_cp_sizes

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--vocab-size", "128", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--lr", "1e-3", "--train-iters", "1"]


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_activation_bytes_fall_as_one_over_cp_and_the_planner_predicts_them(comm):
    rows = run_distributed(measure_cp_sizes, 4, FLAGS, comm_type=comm, timeout=180)[0]
    base = rows[0]["measured_bytes"]
    for r in rows:
        assert r["measured_bytes"] / base == pytest.approx(1 / r["cp"], rel=0.10), r
        assert r["predicted_bytes"] == pytest.approx(r["measured_bytes"], rel=0.10), r


def test_step_time_counts_the_kv_traffic_and_divides_the_compute():
    cluster = load_cluster("h100-80gb-nvlink")
    base = load_config([*FLAGS, "--seq-length", "8192", "--max-position-embeddings", "8192"], 4)
    cp4 = load_config([*FLAGS, "--seq-length", "8192", "--max-position-embeddings", "8192",
                       "--context-parallel-size", "4"], 4)
    a, b = step_time(base, cluster, 1, 10**6), step_time(cp4, cluster, 1, 10**6)
    assert b.terms["compute"] < a.terms["compute"] / 3
    assert "context parallel" in b.terms and "context parallel" not in a.terms
    assert b.model_flops / b.tokens == pytest.approx(a.model_flops / a.tokens)  # per token
    gathered = load_config([*FLAGS, "--seq-length", "8192", "--max-position-embeddings", "8192",
                            "--context-parallel-size", "4", "--cp-comm-type", "all_gather"], 4)
    assert step_time(gathered, cluster, 1, 10**6).terms["context parallel"] > 0  # not hidden
    ring = kv_traffic_bytes(cp4)
    kv = 2 * 2048 * 2 * 64 * 4  # K and V of the rank's 2048 positions, fp32
    assert ring == {"forward": 3 * kv, "backward": 3 * kv + 4 * kv}
