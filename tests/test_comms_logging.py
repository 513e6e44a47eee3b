"""The communication logger (DeepSpeed's ``comms_logger``): sizes, counts and bandwidths of the
collectives megazero issues, against nccl-tests' formulas and against the calls a test makes."""

import json

import pytest
import torch
import torch.distributed as dist

from megazero.config import ConfigError
from megazero.config.observability_schema import CommsLoggerSettings
from megazero.distributed.collectives import all_gather, reduce_scatter
from megazero.observability.comms_logging import (
    CommsLogger,
    bandwidths,
    human_size,
    installed_logger,
    log_summary,
    trimmed_mean,
)
from megazero.testing import run_distributed
from megazero.testing.launch import TINY, check, read_metrics, run_training


def test_bandwidths_follow_nccl_tests():
    # 1 GB in 1 s: algbw 8 Gbps; busbw x 2(n-1)/n for all-reduce, x (n-1)/n for the ring ops
    gb = 10 ** 9
    assert bandwidths("all_reduce", gb, 1000.0, 4) == pytest.approx((8.0, 12.0))
    assert bandwidths("all_gather_into_tensor", gb, 1000.0, 4) == pytest.approx((8.0, 6.0))
    assert bandwidths("reduce_scatter_tensor", gb, 500.0, 8) == pytest.approx((16.0, 14.0))
    assert bandwidths("all_to_all_single", gb, 1000.0, 2) == pytest.approx((8.0, 4.0))
    assert bandwidths("broadcast", gb, 1000.0, 16) == pytest.approx((8.0, 8.0))
    assert bandwidths("batch_isend_irecv", gb, 2000.0, 2) == pytest.approx((4.0, 4.0))
    assert bandwidths("all_reduce", gb, 0.0, 4) == (0.0, 0.0)


def test_table_helpers():
    assert human_size(0) == "0B" and human_size(2048) == "2.0 KB"
    assert human_size(678.86 * 2 ** 20) == "678.86 MB"
    assert trimmed_mean([1.0] * 9 + [100.0]) == 1.0  # the slowest tenth is left out
    assert trimmed_mean([2.0, 4.0]) == 3.0


def test_prof_ops_names_are_checked_once_in_the_config(tmp_path):
    from megazero.config import load_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"comms_logger": {"enabled": True, "prof_all": False,
                                               "prof_ops": ["allreduce"]}}))
    with pytest.raises(ConfigError) as err:
        load_config([*TINY, "--train-iters", "2", "--deepspeed_config", str(ds)], 1)
    assert "comms_logger.prof_ops: 'allreduce'" in str(err.value)
    assert "all_reduce" in str(err.value)  # the names it takes
    settings = CommsLoggerSettings.from_block({"enabled": True, "prof_ops": ["barrier"]})
    assert settings.prof_all and settings.prof_ops == ("barrier",) and not settings.debug


def _calls(rank: int, world: int, settings: dict) -> dict:
    lines: list[str] = []
    logger = CommsLogger(CommsLoggerSettings.from_block(settings), log=lines.append)
    original = dist.all_reduce
    logger.install()
    assert installed_logger() is logger and dist.all_reduce is not original
    x = torch.ones(1000)  # 4000 bytes
    for _ in range(3):
        dist.all_reduce(x)
    work = dist.all_reduce(torch.ones(10), async_op=True)  # timed to completion, still waitable
    work.wait()
    out = torch.empty(2 * 256)
    world_group = dist.group.WORLD
    all_gather(out, torch.full((256,), float(rank)), world_group)  # megazero's, via compat
    shard = torch.empty(256)
    reduce_scatter(shard, torch.ones(512), world_group, "native")
    peer = 1 - rank
    recv = torch.empty(64, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, torch.full((64,), float(rank), dtype=torch.float64), peer),
           dist.P2POp(dist.irecv, recv, peer)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    dist.barrier()
    logger.uninstall()
    dist.all_reduce(x)  # not counted: uninstalled
    return {"rows": logger.rows(), "lines": lines, "restored": dist.all_reduce is original,
            "gathered": out.tolist(), "shard": shard.tolist(), "recv": recv.tolist(),
            "sum": x[0].item(), "summary": logger.summary(), "active": installed_logger()}


def test_counts_sizes_and_results_on_two_ranks():
    results = run_distributed(_calls, 2, {"enabled": True, "verbose": True}, timeout=120)
    for rank, r in enumerate(results):
        by_op = {(name, size): count for name, size, count, *_ in r["rows"]}
        p2p_bytes = 2 * 64 * 8  # sent plus received
        gathered_op = "all_gather_single" if hasattr(dist, "all_gather_single") else \
            "all_gather_into_tensor"
        expected = {("all_reduce", 4000): 3, ("all_reduce", 40): 1, ("barrier", 0): 1,
                    ("batch_isend_irecv", p2p_bytes): 1, (gathered_op, 2048): 1}
        for key, count in expected.items():
            assert by_op.get(key) == count, (rank, key, by_op)
        scattered_op = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else \
            "reduce_scatter_tensor"
        assert by_op.get((scattered_op, 2048)) == 1, by_op  # the unreduced input, 512 floats
        assert r["restored"] and r["active"] is None
        # the ops still did their work
        assert r["gathered"] == [0.0] * 256 + [1.0] * 256
        assert r["shard"] == [2.0] * 256 and r["recv"] == [float(1 - rank)] * 64
        assert r["sum"] == 2.0 ** 4  # three counted all-reduces and one after uninstall
        # verbose: one line per timed op
        assert len(r["lines"]) == sum(by_op.values()), r["lines"]
        assert r["lines"][0].startswith("comm op: all_reduce | time (ms): ")
        assert "msg size: 3.91 KB" in r["lines"][0]
        table = r["summary"].splitlines()
        assert table[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total",
                                    "Latency(ms)", "Avg", "Latency(ms)", "tput_avg", "(Gbps)",
                                    "busbw_avg", "(Gbps)"]
        at = table.index("all_reduce")  # then a row per message size, smallest first
        assert table[at + 1].split()[:3] == ["40.0", "B", "1"]
        assert table[at + 2].split()[:3] == ["3.91", "KB", "3"]
        for name, size, count, total, avg, algbw, busbw in r["rows"]:
            assert count >= 1 and total >= avg > 0, (name, size)
            if size:
                assert algbw > 0 and busbw > 0, (name, size)


def _filtered(rank: int, world: int) -> dict:
    logger = CommsLogger(CommsLoggerSettings.from_block(
        {"enabled": True, "prof_all": False, "prof_ops": ["barrier"], "debug": True}), log=None)
    logger.install()
    dist.all_reduce(torch.ones(4))
    dist.barrier()
    logger.install()  # idempotent
    logger.uninstall()
    return {"rows": [row[:3] for row in logger.rows()]}


def test_prof_ops_and_debug_name_the_caller():
    for r in run_distributed(_filtered, 2, timeout=120):
        assert r["rows"] == [("barrier | [Caller Func: _filtered]", 0, 1)], r


def test_log_summary_needs_an_installed_logger():
    assert installed_logger() is None
    with pytest.raises(RuntimeError, match='"comms_logger": {"enabled": true}'):
        log_summary()


def test_training_prints_the_summary_and_trains_the_same_model(tmp_path):
    """tp 2 x dp 2 with ZeRO-1: the table has the tensor-parallel all-reduces and the gradient
    reduce-scatter and parameter all-gather, which gloo ranks on one host do in shared memory;
    the losses are those of a run without the logger (timing changes when communication
    happens, never what it computes)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1},
                              "comms_logger": {"enabled": True}}))
    args = [*TINY, "--train-iters", "3", "--tensor-model-parallel-size", "2",
            "--eval-iters", "0", "--distributed-backend", "gloo"]
    logged = run_training([*args, "--deepspeed_config", str(ds),
                           "--log-json", str(tmp_path / "on.jsonl")], nproc=4)
    out = check(logged)
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    check(run_training([*args, "--deepspeed_config", str(ds),
                        "--log-json", str(tmp_path / "off.jsonl")], nproc=4))
    losses = [[m["lm loss"] for _, m in sorted(read_metrics(tmp_path / f"{name}.jsonl").items())]
              for name in ("on", "off")]
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses
    summary = out[out.index("communication summary"):].splitlines()
    assert summary[1].startswith("Comm. Op")
    ops = [line for line in summary[2:] if line and not line.startswith(" ")]
    assert {"all_reduce", "shm_reduce_scatter", "shm_all_gather"} <= set(ops), summary
    assert out.count("communication summary") == 1  # rank 0 only


def _engine_summary(rank: int, world: int) -> dict:
    import contextlib
    import io

    import megazero
    from megazero.observability import comms_logging
    from megazero.testing.engine_runs import batches, build, ds_config, loss_of

    engine, *_ = megazero.initialize(
        model=build("tiny"), dist_init_required=False,
        config=ds_config(2, comms_logger={"enabled": True, "prof_all": False,
                                          "prof_ops": ["all_reduce", "all_gather"]}))
    mine = batches(1, 8)[0][rank * 4:(rank + 1) * 4]  # this rank's two micro-batches of 2
    for ids in mine.split(2):
        engine.backward(loss_of("tiny", engine, ids))
        engine.step()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        comms_logging.log_summary()
    logger = comms_logging.installed_logger()
    assert logger is not None
    logger.uninstall()
    return {"printed": printed.getvalue(), "ops": sorted({row[0] for row in logger.rows()})}


def test_engine_api_installs_the_logger_and_log_summary_prints_on_rank_0():
    """megazero.initialize with "comms_logger" (only the ops in prof_ops); the summary is
    printed where the user calls log_summary, by rank 0."""
    ranks = run_distributed(_engine_summary, 2, timeout=120)
    for r in ranks:
        assert r["ops"] and set(r["ops"]) <= {"all_reduce", "all_gather"}, r["ops"]
    assert ranks[0]["printed"].startswith("Comm. Op") and "all_reduce" in ranks[0]["printed"]
    assert ranks[1]["printed"] == ""
