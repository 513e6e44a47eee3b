"""The multi-rank harness: results, failures with rank numbers, hangs within the timeout."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megazero.testing import DistributedTestError, run_distributed


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item() * scale, "threads": torch.get_num_threads(),
            "pid": os.getpid()}


def _raise_on_rank_2(rank, world_size):
    if rank == 2:
        raise ValueError("boom on purpose")
    return rank


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()  # the other ranks wait for rank 1 forever
    return rank


def _pid_then_hang(rank, world_size, pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(3600)


def _die_hard(rank, world_size):
    if rank == 0:
        os._exit(7)
    time.sleep(3600)


def _die_then_peer_fails(rank, world_size):
    if rank == 0:
        os._exit(7)
    time.sleep(0.3)  # the consequence, reported while rank 0 is already gone
    raise RuntimeError("Connection closed by peer")


def test_results_from_every_rank():
    out = run_distributed(_sum_of_ranks, 8, 2.0, timeout=60)
    assert [o["rank"] for o in out] == list(range(8))
    assert all(o["sum"] == 2.0 * 28 for o in out)
    assert all(o["threads"] == 1 for o in out)
    assert len({o["pid"] for o in out}) == 8


def test_failure_names_rank_and_traceback():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_raise_on_rank_2, 4, timeout=60)
    msg = str(err.value)
    assert "rank 2 of 4 failed" in msg and "boom on purpose" in msg and "Traceback" in msg


def test_hang_fails_within_timeout_and_leaves_no_process(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="did not finish within 3s"):
        run_distributed(_pid_then_hang, 3, str(tmp_path), timeout=3)
    assert time.monotonic() - start < 15
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 3
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_collective_hang_reports_missing_rank():
    with pytest.raises(DistributedTestError, match=r"ranks \[0, 1\] still running"):
        run_distributed(_hang_on_rank_1, 2, timeout=3)


def test_rank_that_dies_is_reported():
    with pytest.raises(DistributedTestError, match="rank 0 of 2 died with exit code 7"):
        run_distributed(_die_hard, 2, timeout=30)


def test_a_death_is_reported_before_the_peer_failure_it_caused():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_die_then_peer_fails, 2, timeout=30)
    assert "rank 0 of 2 died with exit code 7" in str(err.value)
    assert "rank 1 failed after it" in str(err.value) and "Connection closed" in str(err.value)
