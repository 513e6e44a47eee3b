"""Fault injection for the healing tests: a process killed (SIGKILL) at a chosen moment of an
asynchronous save, a rank killed or slowed in a launched job, a rank throttled from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

#: a ``pretrain_gpt.py`` wrapper: ``python KILL_RANK_WRAPPER pretrain_gpt.py ...`` kills rank
#: ``KILL_RANK`` with SIGKILL after iteration ``KILL_AT - 1``, on the first attempt only
KILL_RANK_WRAPPER = r"""
import os, runpy, signal, sys
import megazero.training.loop as loop
step = loop.train_step
def killing(run, *a, **k):
    out = step(run, *a, **k)
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ["RANK"] == os.environ["KILL_RANK"]
            and run.state.iteration + 1 == int(os.environ["KILL_AT"])):
        os.kill(os.getpid(), signal.SIGKILL)
    return out
loop.train_step = killing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: a ``pretrain_gpt.py`` wrapper: rank ``SLOW_RANK`` sleeps ``SLOW_S`` seconds in every step
SLOW_RANK_WRAPPER = r"""
import os, runpy, sys, time
import megazero.training.loop as loop
step = loop.train_step
def slow(run, *a, **k):
    if os.environ["RANK"] == os.environ["SLOW_RANK"]:
        time.sleep(float(os.environ["SLOW_S"]))
    return step(run, *a, **k)
loop.train_step = slow
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def kill_at_commit(iteration: int, count: int, before_rename: bool) -> None:
    """From now on, this process dies (SIGKILL) at the ``count``-th file committed into the
    checkpoint of ``iteration`` (its shards, config.json, metadata.json, then the tracker), just
    before the rename that makes it visible or just after."""
    from megazero.checkpoint.files import Writer
    from megazero.checkpoint.reader import TRACKER

    commit = Writer.commit
    seen = [0]
    tag = f"iter_{iteration:07d}"

    def dying(self: Writer, tmp: str, path: str) -> None:
        ours = tag in path or (path.endswith(TRACKER) and os.path.basename(tmp).startswith(
            TRACKER) and open(tmp, encoding="utf-8").read().strip() == str(iteration))
        if ours:
            seen[0] += 1
        if ours and seen[0] == count and before_rename:
            os.kill(os.getpid(), signal.SIGKILL)
        commit(self, tmp, path)
        if ours and seen[0] == count:
            os.kill(os.getpid(), signal.SIGKILL)

    Writer.commit = dying  # type: ignore[method-assign]


class Throttle:
    """Stop and continue a process so that it runs ``duty`` of every ``period`` seconds (as a
    CPU quota or a noisy neighbour would), until :meth:`stop`."""

    def __init__(self, pid: int, duty: float, period: float = 0.1) -> None:
        self.pid, self.duty, self.period = pid, duty, period
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.period * (1 - self.duty))
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.period * self.duty)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_throttled(cmd: list[str], rank: int, duty: float, env: dict[str, str], cwd: str,
                  timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher command (torchrun) with one of its ranks throttled to ``duty``."""
    from megazero.testing.faults import launched_ranks

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    throttle = None
    deadline = time.monotonic() + 60
    while proc.poll() is None and throttle is None and time.monotonic() < deadline:
        pid = launched_ranks(proc.pid).get(rank)
        if pid is not None:
            throttle = Throttle(pid, duty).start()
        time.sleep(0.05)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if throttle is not None:
            throttle.stop()
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
