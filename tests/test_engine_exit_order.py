"""A script whose process group ``megazero.init_distributed`` made leaves it in order: no rank
closes its connections before every peer has reached the end of the script (gloo aborts a peer
still talking to a rank that left: "terminate called without an active exception"), and after
an uncaught exception a rank leaves without waiting for peers that may never come."""

from __future__ import annotations

import re
import subprocess

from megazero.testing.launch import REPO, TORCHRUN, env

# Rank 1 reaches the end of the script LATE seconds after rank 0. The hook registered before
# init_distributed runs after its exit hook (atexit is last in, first out): it stamps the
# moment the rank has really left the process group.
SCRIPT = r"""
import atexit, sys, time
import torch.distributed as dist
import megazero

atexit.register(lambda: print(f"LEFT {time.time():.3f}", flush=True))
megazero.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
if rank == 0 and sys.argv[2] == "raise":
    print(f"RAISE0 {time.time():.3f}", flush=True)
    raise RuntimeError("rank 0 fails at the end of its script")
if rank == 1:
    time.sleep(float(sys.argv[1]))
    print(f"END1 {time.time():.3f}", flush=True)
"""
LATE = 2.0


def _run(tmp_path, rank0_ends: str) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "--tee", "3", str(script),
           str(LATE), rank0_ends]
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=120)
    stamps = {f"{kind}{rank}": float(t) for rank, kind, t in
              re.findall(r"^\[(?:default)?(\d)\]:(LEFT|END|RAISE)\d? ([0-9.]+)$", proc.stdout,
                         re.M)}
    return proc, stamps


def test_no_rank_leaves_before_its_peers_are_done(tmp_path):
    proc, t = _run(tmp_path, "normally")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert set(t) == {"LEFT0", "LEFT1", "END1"}, proc.stdout
    # rank 0 finished its script LATE seconds earlier, and still left only after rank 1 was done
    assert t["LEFT0"] >= t["END1"], t
    assert "terminate called" not in proc.stderr


def test_after_an_uncaught_exception_the_rank_does_not_wait(tmp_path):
    proc, t = _run(tmp_path, "raise")
    assert proc.returncode != 0
    assert "rank 0 fails at the end of its script" in proc.stderr + proc.stdout
    assert "RAISE0" in t and "LEFT0" in t, proc.stdout
    # rank 0 left at once: a barrier would have held it until rank 1 came, LATE s later
    assert t["LEFT0"] - t["RAISE0"] < LATE / 2, t
