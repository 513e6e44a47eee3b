"""Hangs end: group timeouts from --distributed-timeout-minutes, the watchdog's stuck-phase and
dead-launcher exits, each with one message naming the cause."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from megazero.errors import attempt_key
from megazero.testing.distributed import DistributedTestError, run_distributed
from megazero.training.watchdog import WATCHDOG_EXIT_CODE, Watchdog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stuck_peer(rank, world_size, out_dir):
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(60)  # a frozen rank: never joins the collective, never reports
        return None
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as out:
        with open(os.path.join(out_dir, "start.txt"), "w") as f:
            f.write(repr(time.time()))
        wd = Watchdog(1.0, rank, poll_s=0.05, out=out).start()
        with wd.phase("iteration 3: gradient sync", "dp", [0, 1]):
            dist.all_reduce(torch.ones(1))
    return "not reached"


def test_watchdog_ends_the_rank_waiting_on_a_stuck_peer(tmp_path):
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_stuck_peer, 2, str(tmp_path), timeout=60)
    # Timed from the phase's start, not the world's (starting processes on a loaded machine
    # takes long): the stuck peer would have answered after 60 s.
    ended = time.time() - float((tmp_path / "start.txt").read_text())
    assert f"rank 0 of 2 died with exit code {WATCHDOG_EXIT_CODE}" in str(e.value)
    assert ended < 15, ended
    msg = (tmp_path / "rank0.txt").read_text().splitlines()
    assert len(msg) == 1, msg
    assert msg[0].startswith("[rank 0] watchdog: iteration 3: gradient sync over the dp group "
                             "(ranks [0, 1]) has not finished after ")
    waited = float(msg[0].split("after ")[1].split("s ")[0])
    assert 1.0 <= waited < 6.0  # the limit, plus the thread's poll on a loaded machine


def test_watchdog_phases_nest_and_stay_quiet_within_the_limit():
    now = [0.0]
    fired = []
    wd = Watchdog(10.0, 3, watch_parent=False, exit=fired.append, clock=lambda: now[0])
    assert wd.check() is None  # nothing watched
    with wd.phase("outer", "world", [0, 1]):
        now[0] = 5.0
        with wd.phase("inner", "tp", [2, 3]):
            now[0] = 14.0
            assert wd.check() is None  # inner began at 5
            now[0] = 15.5
            assert "inner over the tp group (ranks [2, 3])" in wd.check()
        assert "[rank 3] watchdog: outer over the world group" in wd.check()
    assert wd.check() is None and not fired
    assert wd.take_voice() and not wd.take_voice()  # the thread and the loop: one speaks


def _group_timeout(rank, world_size, tmp):
    import torch
    import torch.distributed as dist

    from megazero.distributed.topology import ParallelTopology

    topo = ParallelTopology.build(timeout=timedelta(seconds=2))
    done = os.path.join(tmp, "rank0-done")
    if rank == 1:  # stays away from the collective until rank 0 gave up on it (at most 30 s)
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    wd = Watchdog(60.0, rank, watch_parent=False)
    t0 = time.monotonic()
    try:
        with wd.phase("iteration 7: gradient sync", "dp", topo.ranks("dp")):
            dist.all_reduce(torch.ones(1), group=topo.dp_group)
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)[:200], wd.failure_message(e)
    finally:
        open(done, "w").close()
    return None


def test_topology_groups_use_the_distributed_timeout(tmp_path):
    """Without the timeout, new_group takes gloo's 30 minutes and this world hangs. The
    backend's timeout error becomes one line naming the phase and the group."""
    waited, err, message = run_distributed(_group_timeout, 2, str(tmp_path), timeout=60)[0]
    # 2 s, plus room for a loaded machine; without the timeout rank 0 waits for rank 1 (30 s)
    assert 1.5 < waited < 10, (waited, err)
    assert message.startswith("[rank 0] iteration 7: gradient sync over the dp group (ranks "
                              "[0, 1]) failed after "), message
    assert "Timed out" in message and message.endswith("ending the job")
    assert Watchdog(1.0, 0).failure_message(ValueError("x")) is None


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"),
                             stderr=subprocess.STDOUT)
    for _ in range(1200):  # up to 60 s: the child must own its watchdog before we leave
        if open(sys.argv[2]).read().startswith("ready"):
            break
        time.sleep(0.05)
    print(child.pid, flush=True)
""")
CHILD = textwrap.dedent("""
    import sys, time
    from megazero.training.watchdog import Watchdog
    Watchdog(1000.0, 5, poll_s=0.05).start()
    print("ready", flush=True)
    time.sleep(60)
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] == "Z" for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


def test_orphaned_rank_exits_when_its_launcher_dies(tmp_path):
    out = tmp_path / "child.txt"
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", PARENT, CHILD, str(out)], env=env,
                          capture_output=True, text=True, timeout=60)
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _gone(pid), "the orphaned child is still running"
    finally:
        if not _gone(pid):
            os.kill(pid, 9)
    lines = out.read_text().splitlines()
    assert lines[0] == "ready"
    assert lines[1].startswith("[rank 5] watchdog: the launcher (parent pid ")
    assert len(lines) == 2 and lines[1].endswith("is gone; ending this orphaned rank")


class _Store:
    """The two calls PeerRegistry makes of a torch.distributed store."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_peer_registry_names_dead_and_stopped_peers_and_ends_the_stopped():
    import signal
    import socket

    from megazero.distributed.peers import PeerRegistry, _stat

    store = _Store()
    PeerRegistry(store, 0).register()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        for rank, proc in ((1, stopped), (2, dead)):
            start = _stat(proc.pid)[1] if rank == 1 else "1"
            store.set(attempt_key(f"proc/{rank}"), f"{socket.gethostname()} {proc.pid} {start}")
        store.set(attempt_key("proc/3"), "elsewhere 1 1")  # another host: cannot be looked at
        # a recycled pid: this very process, but not the start time registered for rank 5
        store.set(attempt_key("proc/5"), f"{socket.gethostname()} {os.getpid()} 1")
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _stat(stopped.pid)[0] not in "Tt" and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = []
        reg = PeerRegistry(store, 0, kill=lambda pid, sig: killed.append((pid, sig)))
        # itself and a peer elsewhere: nothing to say (after a second's look)
        assert reg.diagnose([0, 3], settle_s=0.1) is None
        # a phase over a group of this rank alone (the mp group at tp=pp=1): the world is
        # looked at too
        world = PeerRegistry(store, 0, 6, kill=lambda pid, sig: None)
        assert f"rank 2 (pid {dead.pid})" in world.diagnose([0])
        said = reg.diagnose([0, 1, 2, 3, 4, 5])  # rank 4 never registered
        assert said == (f"rank 2 (pid {dead.pid}), rank 5 (pid {os.getpid()}) have died "
                        f"(killed or crashed; see its own output and the launcher's); rank 1 "
                        f"(pid {stopped.pid}) is stopped (SIGSTOP or a debugger), so it was "
                        f"sent SIGKILL"), said
        assert killed == [(stopped.pid, signal.SIGKILL)]
        wd = Watchdog(1.0, 0, watch_parent=False, diagnose=PeerRegistry(store, 0).diagnose)
        with pytest.raises(RuntimeError), wd.phase("iteration 2: gradient sync", "dp", [0, 1]):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        msg = wd.failure_message(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
        assert msg.endswith(f"Connection closed by peer [127.0.0.1]:1234. rank 1 (pid "
                            f"{stopped.pid}) is stopped (SIGSTOP or a debugger), so it was sent "
                            f"SIGKILL; ending the job"), msg
        assert stopped.wait(timeout=10) == -signal.SIGKILL  # really ended
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()


def test_sigterm_is_held_until_the_survivor_has_spoken():
    """torchrun SIGTERMs a survivor the moment its peer dies; the line naming the dead peer
    must come out first. Inside the block the signal is recorded; after it, delivered."""
    import signal

    from megazero.training.exit_conditions import sigterm_deferred

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("handler"))
    try:
        with sigterm_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            seen.append("message")
        time.sleep(0.05)
        assert seen == ["message", "handler"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_stopped_peer_is_called_stopped_by_every_survivor():
    """Two survivors look at a SIGSTOPped peer: the first ends it, the second finds it gone.
    Both must name it stopped (the diagnosis is recorded before the kill), not "died"."""
    import signal
    import socket

    from megazero.distributed.peers import PeerRegistry, _stat

    store = _Store()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.set(attempt_key("proc/2"), f"{socket.gethostname()} {stopped.pid} "
                                     f"{_stat(stopped.pid)[1]}")
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _stat(stopped.pid)[0] not in "Tt" and time.monotonic() < deadline:
            time.sleep(0.01)
        first = PeerRegistry(store, 0).diagnose([0, 1, 2])
        stopped.wait(timeout=10)  # really ended by the first survivor
        second = PeerRegistry(store, 1).diagnose([0, 1, 2], settle_s=0.1)
        assert "is stopped (SIGSTOP or a debugger)" in first, first
        assert second is not None and "is stopped" in second and "died" not in second, second
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()
