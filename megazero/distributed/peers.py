"""Which peer rank is dead or frozen: each rank records its host and process in the job's store,
so a rank whose collective failed can name the culprit instead of "a peer".

Why: when one rank is killed (OOM killer, ``kill -9``, a crashed node) or frozen (``SIGSTOP``,
a debugger, a stalled file system), its peers only see the backend's error ("Connection reset
by peer", "Timed out waiting 3000ms") with an address, not a rank; the launcher's own summary
may even name a survivor as the root cause. At start-up every rank writes
``megazero/proc/<rank> = "<host> <pid> <start time>"`` into the default store (one key, no
collective). When a collective fails, the failing rank reads its group's entries and, for the
peers on its own host, looks at ``/proc/<pid>/stat``: gone, a zombie or a recycled pid means the
rank died; state ``T`` means it is stopped. Peers on other hosts cannot be looked at and are not
named.

The diagnosis of a stopped peer is decided once: the survivor that finds it stopped records
``megazero/stopped/<rank>`` in the store *before* ending it, so a survivor that looks after the
kill (and finds the process gone) still says "stopped", not "died".

A stopped peer is ended with ``SIGKILL``: the job is ending, the launcher's ``SIGTERM`` cannot
act on a stopped process (``torchrun`` waits ``--shutdown_timeout``, 30 s, before its own
``SIGKILL``), and until then the frozen rank holds its GPU memory and ports.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from megazero.errors import attempt_key


def _key(rank: int) -> str:
    return attempt_key(f"proc/{rank}")


def _stopped(rank: int) -> str:  # set before a stopped peer is killed
    return attempt_key(f"stopped/{rank}")


_PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is in its exit (a kill -9 under way)


def _stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of ``pid``, or None when there is no such
    process. A process inside its exit reads as ``X``: its sockets close (the survivor sees
    "Connection reset") before it turns into a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    rest = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    state = "X" if int(rest[6]) & _PF_EXITING else rest[0]
    return state, rest[19]


def this_process() -> str:
    stat = _stat(os.getpid())
    return f"{socket.gethostname()} {os.getpid()} {stat[1] if stat else '?'}"


class PeerRegistry:
    """This job's ranks' processes, read back from ``store`` (a ``torch.distributed`` store)."""

    def __init__(self, store: Any, rank: int, world_size: int = 0,
                 kill: Callable[[int, int], None] = os.kill) -> None:
        self.store, self.rank, self.world_size, self._kill = store, rank, world_size, kill

    def register(self) -> PeerRegistry:
        self.store.set(_key(self.rank), this_process())
        return self

    def _entry(self, rank: int) -> tuple[str, int, str] | None:
        key = _key(rank)
        try:
            if not self.store.check([key]):
                return None
            host, pid, start = self.store.get(key).decode().split()
            return host, int(pid), start
        except Exception:  # noqa: BLE001 - no store (its host is gone too): nothing to say
            return None

    def _record_stopped(self, rank: int) -> None:
        try:
            self.store.set(_stopped(rank), "1")
        except Exception:  # noqa: BLE001 - no store: the kill goes ahead, undiagnosed for others
            pass

    def _was_stopped(self, rank: int) -> bool:
        try:
            return bool(self.store.check([_stopped(rank)]))
        except Exception:  # noqa: BLE001
            return False

    def diagnose(self, ranks: Sequence[int], settle_s: float = 1.0) -> str | None:
        """What is wrong with the peers among ``ranks`` on this host, or None if nothing seen
        within ``settle_s`` (a killed peer may still be finishing its exit when its closed
        connection is noticed). Ends a stopped peer (see the module docstring)."""
        deadline = time.monotonic() + settle_s
        # The rest of the world too: a phase names the group it waits on, but a collective of
        # another group may run inside it (the dp gradient sync overlapped with the backward).
        rest = [r for r in range(self.world_size) if r not in set(ranks)]
        while True:
            said = self._look(ranks) or self._look(rest)
            if said is not None or time.monotonic() >= deadline:
                return said
            time.sleep(0.05)

    def _look(self, ranks: Sequence[int]) -> str | None:
        host = socket.gethostname()
        dead: list[str] = []
        stopped: list[str] = []
        for r in ranks:
            entry = self._entry(r) if r != self.rank else None
            if entry is None or entry[0] != host:
                continue
            _, pid, start = entry
            stat = _stat(pid)
            if stat is None or stat[0] in "ZXx" or stat[1] != start:
                (stopped if self._was_stopped(r) else dead).append(f"rank {r} (pid {pid})")
            elif stat[0] in "Tt":
                stopped.append(f"rank {r} (pid {pid})")
                self._record_stopped(r)
                try:
                    self._kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        said = []
        if dead:
            said.append(f"{', '.join(dead)} {'has' if len(dead) == 1 else 'have'} died "
                        f"(killed or crashed; see its own output and the launcher's)")
        if stopped:
            said.append(f"{', '.join(stopped)} {'is' if len(stopped) == 1 else 'are'} stopped "
                        f"(SIGSTOP or a debugger), so it was sent SIGKILL")
        return "; ".join(said) if said else None
