"""Two ``torchrun`` launchers (two "nodes" on loopback, 2 processes each) train as one world."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from megazero.testing.launch import LOSS_RTOL, REPO, SCRIPT, TINY, TORCHRUN, env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_form_one_world(tmp_path):
    port = _free_port()
    args = [*TINY, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--train-iters", "4", "--log-json", str(tmp_path / "m.jsonl")]
    procs = []
    for node in (0, 1):
        cmd = [TORCHRUN, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(port), SCRIPT, *args]
        procs.append(subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    # Rank 0 (node 0) reports for the whole world of 4: tp 2 x pp 2 spans both nodes.
    assert "> world 4 (gloo): tp 2 x pp 2 x dp 1" in outs[0]
    assert "lm loss:" not in outs[1]
    recs = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    losses = [r["lm loss"] for r in recs if "learning-rate" in r]
    assert len(losses) == 4 and all(3.0 < x < 6.0 for x in losses), losses
    # Same numbers as one launcher with 4 processes would give: compare with a single-process
    # run of the same model (layout independence).
    ref = tmp_path / "ref.jsonl"
    one = subprocess.run([sys.executable, SCRIPT, *TINY, "--train-iters", "4", "--log-json",
                          str(ref)], env=env(), cwd=REPO, capture_output=True, text=True,
                         timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    ref_losses = [json.loads(line)["lm loss"] for line in open(ref)
                  if "learning-rate" in json.loads(line)]
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0)
