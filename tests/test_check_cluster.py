"""tools/check_cluster.py on 4 gloo ranks: the table's rows, PASS where the cluster is sound,
and a layout that trains a different model (a planted learning-rate change) FAILs with a
non-zero exit. The binding judge and the bus-bandwidth formulas are checked on made-up input."""

import re

import pytest

from megazero.cluster_check import Row, exit_code, format_table
from megazero.cluster_check.bandwidth import bus_bandwidth_gbps, job_sizes, nominal_gbps
from megazero.cluster_check.binding import judge
from megazero.testing import run_distributed
from megazero.testing.cluster_check_runs import check_cluster_world
from megazero.testing.distributed import preload

# the ranks start with the training code imported, and torch._dynamo, which torch.optim imports
# on first use (3 s; paid once by the forkserver, not by 4 ranks at once on 2 cores)
preload("torch._dynamo", "megazero.training.loop", "megazero.cluster_check.run")
FAST = ["--size", "0.25", "--bandwidth-iters", "2", "--train-iters", "3"]


def test_check_cluster_on_four_gloo_ranks(tmp_path):
    argv = [*FAST, "--workdir", str(tmp_path / "ok")]
    code, text = run_distributed(check_cluster_world, 4, argv, timeout=300)[0]
    rows = re.findall(r"^(PASS|FAIL|SKIP)  (.+?)  ", text, re.M)
    names = [n.strip() for _, n in rows]
    assert code == 0, text
    assert all(s == "PASS" for s, _ in rows), text
    assert names[0] == "device binding"
    for op in ("dp all_reduce", "dp reduce_scatter", "dp all_gather", "world broadcast",
               "world sendrecv"):
        assert f"{op} 256 KiB" in names, text
    for stage in range(4):
        assert f"zero-{stage} fp32 vs 1 rank" in names and f"zero-{stage} fp32 save+resume" \
            in names
    assert "zero-2 fp32 cpu-offload vs 1 rank" in names
    for r in range(4):  # each rank's own timing against the others'
        assert f"rank {r} compute" in names and f"rank {r} links" in names, text
    assert "4 rank(s) on 1 node(s)" in text and "24 checks, all passed" in text
    assert not (tmp_path / "ok").exists()  # checkpoints removed

    # a tp 2 x pp 2 job's collectives (over its tensor-parallel groups and between pipeline
    # neighbours), and a planted mismatch in the training rows
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--size", "0.25", "--bandwidth-iters", "1", "--zero-stages", "1", "--no-offload",
            "--train-iters", "2", "--workdir", str(tmp_path / "planted")]
    code, text = run_distributed(check_cluster_world, 4, argv, plant_lr_at_stage=1,
                                 timeout=300)[0]
    assert code == 1, text
    assert re.search(r"^FAIL  zero-1 fp32 vs 1 rank .*max rel diff .* \(> 1e-05\)", text,
                     re.M), text
    assert re.search(r"^PASS  zero-1 fp32 save\+resume", text, re.M), text
    for op in ("tp all_reduce", "tp reduce_scatter", "tp all_gather", "world broadcast",
               "pp sendrecv"):
        assert re.search(rf"^PASS  {op} 256 KiB .*2 ranks\)|^PASS  {op} 256 KiB .*4 ranks\)",
                         text, re.M), (op, text)
    assert "dp all_reduce" not in text  # dp is 1 at tp 2 x pp 2 on 4 ranks


def test_binding_judge_and_bus_bandwidth():
    def rec(rank, host, local, gpu, index, expected):
        return {"host": host, "rank": rank, "local_rank": local, "device": f"cuda:{index}",
                "gpu": gpu, "index": index, "expected": expected, "error": None}

    good = [rec(r, f"n{r // 2}", r % 2, f"GPU-{r}", r % 2, r % 2) for r in range(4)]
    assert judge(good).status == "PASS" and "4 rank(s) on 2 node(s)" in judge(good).detail
    shared = [rec(0, "n0", 0, "GPU-a", 0, 0), rec(1, "n0", 1, "GPU-a", 0, 0)]
    assert "share GPU GPU-a on n0" in judge(shared).detail
    wrong = [rec(0, "n0", 1, "GPU-a", 0, 1)]
    assert judge(wrong).status == "FAIL" and "gives cuda:1" in judge(wrong).detail
    # nccl-tests: busbw = bytes / time * factor
    assert bus_bandwidth_gbps("all_reduce", 10**9, 1.0, 8) == pytest.approx(1.75)
    assert bus_bandwidth_gbps("all_gather", 10**9, 0.5, 4) == pytest.approx(1.5)
    assert bus_bandwidth_gbps("sendrecv", 10**9, 1.0, 8) == pytest.approx(1.0)
    assert nominal_gbps("NVIDIA H100 80GB HBM3", 1) == 450.0
    assert nominal_gbps("NVIDIA H100 PCIe", 1) == 64.0
    assert nominal_gbps("NVIDIA H100 80GB HBM3", 2) == 50.0 and nominal_gbps("cpu", 1) is None
    sizes = job_sizes([2**20], 4096, 2048, 1, 40_000_000)
    assert sizes["sendrecv"] == [2**20, 2 * 2048 * 4096]
    assert sizes["all_reduce"] == [2**20, 2 * 2048 * 4096, 160_000_000]
    rows = [Row("a", "PASS", ""), Row("b", "FAIL", "x")]
    assert exit_code(rows) == 1 and "2 checks, 1 failed" in format_table(rows)
