"""A slow rank is named: by ``--log-straggler`` in a training run (each log interval's busy time
per rank, and one warning for a rank that stays slow) and by ``tools/check_cluster.py``'s
per-rank rows (compute and links). A healthy run names nobody."""

from __future__ import annotations

import os
import re
import subprocess

from megazero.cluster_check.per_rank import judge, pairings
from megazero.testing.healing_runs import SLOW_RANK_WRAPPER, run_throttled
from megazero.testing.launch import SCRIPT, TINY, TORCHRUN, env

REPO = os.path.dirname(SCRIPT)
LINE = re.compile(r"stragglers: .*fastest rank (\d) .*slowest rank (\d) ")


def _run(tmp_path, slow_s: float) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "slow.py"
    wrapper.write_text(SLOW_RANK_WRAPPER)
    args = [*TINY, "--train-iters", "12", "--log-interval", "2", "--log-straggler"]
    return subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", str(wrapper),
                           SCRIPT, *args], cwd=REPO, env={**env(), "SLOW_RANK": "1",
                                                          "SLOW_S": str(slow_s)},
                          capture_output=True, text=True, timeout=300)


def test_log_straggler_names_a_slow_rank_and_not_a_healthy_one(tmp_path):
    slow = _run(tmp_path, 0.3)  # rank 1 sleeps in every step
    assert slow.returncode == 0, slow.stderr[-3000:]
    lines = LINE.findall(slow.stdout)
    # named slowest every interval (one interval of a loaded machine may say otherwise)
    assert len(lines) == 6 and sum(s == "1" for _, s in lines) >= 5, slow.stdout
    warnings = [x for x in slow.stdout.splitlines() if "is a straggler" in x]
    assert len(warnings) == 1 and warnings[0].startswith("warning: rank 1 is a straggler"), \
        slow.stdout
    assert "for 3 log intervals in a row" in warnings[0]  # named after 3 intervals, once
    healthy = _run(tmp_path, 0.0)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    assert len(LINE.findall(healthy.stdout)) == 6 and "is a straggler" not in healthy.stdout


def test_check_cluster_names_a_throttled_rank(tmp_path):
    """Rank 1 of 4 runs 15% of the time (stopped and continued, as a CPU quota does): its
    per-rank rows fail, naming it; the other ranks' pass."""
    tool = os.path.join(REPO, "tools", "check_cluster.py")
    proc = run_throttled([TORCHRUN, "--standalone", "--nproc_per_node", "4", tool,
                          "--distributed-backend", "gloo", "--no-training", "--no-collectives",
                          "--workdir", str(tmp_path / "work")], rank=1, duty=0.15, env=env(),
                         cwd=REPO, timeout=400)
    assert proc.returncode != 0, proc.stdout[-3000:]
    rows = re.findall(r"^(PASS|FAIL|SKIP)  rank (\d) (compute|links)", proc.stdout, re.M)
    assert len(rows) == 8, proc.stdout
    failed = {(r, what) for status, r, what in rows if status == "FAIL"}
    assert failed and {r for r, _ in failed} == {"1"}, proc.stdout


def test_the_round_robin_meets_every_pair_once_and_judge_names_the_slow_rank():
    for n in range(2, 10):
        pairs = [frozenset(p) for rnd in pairings(n) for p in rnd]
        assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2, n
        for rnd in pairings(n):
            ranks = [r for p in rnd for r in p]
            assert len(ranks) == len(set(ranks)), (n, rnd)  # one pair per rank per round
    rows = judge("compute", "t:", [0.1, 0.32, 0.11, 0.1], 2.0)
    assert [r.status for r in rows] == ["PASS", "FAIL", "PASS", "PASS"]
    assert rows[1].name == "rank 1 compute" and "3.20x the other ranks' median" in rows[1].detail
