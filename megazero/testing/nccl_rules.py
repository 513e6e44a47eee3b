"""A test mode that holds gloo runs to the rules NCCL enforces (or hangs on) but gloo forgives.

Gloo takes host tensors, tolerates a rank that issues an extra all-gather as long as the bytes
happen to line up, and waits patiently for a rank doing solo work. On a cluster each of these is
a crash or a hang. With the mode on, every ``torch.distributed`` collective and point-to-point
call made by a rank of :func:`megazero.testing.run_distributed` goes through a wrapper that:

1. **refuses host-resident tensors**: a tensor that megazero keeps on the host on purpose
   (offloaded masters and moments, pinned staging, NVMe swap buffers, checkpoint I/O buffers:
   everything allocated by :func:`megazero.distributed.host_resident.host_empty` or passed to
   ``mark``) raises :class:`NcclRuleError` naming the op, the group and the tensor;
2. **logs** ``(op, dtype, element count, root/peer)`` per group (keyed by the group's global
   ranks; a point-to-point pair is keyed ``src->dst``) to a per-rank file, flushed per entry;
   :class:`LogReader` requires every member of each group to have issued the same sequence and
   reports the first divergence: after the run, and once a second while it runs (ranks whose
   calls diverged usually hang on gloo too, and are then failed at once instead of at the
   world's timeout);
3. **times blocking calls** (``async_op=False``, barriers, send/recv): a call that waited
   longer than the wait limit (``MEGAZERO_NCCL_RULES_WAIT_S``, default 60 s; a test can pass a
   small one) raises :class:`NcclRuleError`: under NCCL that wait is bounded by the group's
   timeout (``--distributed-timeout-minutes``, 10 minutes by default), so work one rank does
   alone while the others sit in a collective must either be done by every rank or waited for
   outside a collective. Asynchronous work handles are not timed.

The calls are wrapped in ``torch.distributed`` and ``torch.distributed.distributed_c10d`` (so
``P2POp``/``batch_isend_irecv`` and the object collectives go through them too) and wherever a
megazero module already holds a reference to the original function
(``megazero.distributed.compat``'s aliases, ``from ... import`` copies), so megazero's wrappers in
:mod:`megazero.distributed.collectives` and :mod:`megazero.distributed.group_comm` are covered
whichever way they reach torch.

**Shared-memory collectives** (:mod:`megazero.distributed.shm_collectives`) stay on in the
mode, and their ``/dev/shm`` buffers are not host-resident: that path is taken only by gloo
groups whose ranks share one host (:func:`~megazero.distributed.shm_collectives.shared_host_group`
refuses any other backend), so under NCCL it does not exist and its buffers never reach an NCCL
collective. What it does issue on the backend (1-element barrier all-reduces, the setup's object
all-gathers) is logged and compared like everything else.

Switched on by ``MEGAZERO_NCCL_RULES=1`` in the environment of the test process (read when a
world starts), by ``run_distributed(..., nccl_rules=True)``, or by ``pytest --nccl-rules``;
``tests/conftest.py`` forces it on for the ZeRO, offload, NVMe, checkpoint and engine suites.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megazero.distributed import host_resident

ENV = "MEGAZERO_NCCL_RULES"
WAIT_ENV = "MEGAZERO_NCCL_RULES_WAIT_S"
DEFAULT_WAIT_S = 60.0

# op name -> (argument holding the root/peer rank, whether it is point-to-point)
_OPS: dict[str, tuple[str | None, bool]] = {
    "all_reduce": (None, False), "reduce": ("dst", False), "broadcast": ("src", False),
    "all_gather": (None, False), "all_gather_into_tensor": (None, False),
    "all_gather_single": (None, False), "_all_gather_base": (None, False),
    "reduce_scatter": (None, False), "reduce_scatter_tensor": (None, False),
    "reduce_scatter_single": (None, False), "_reduce_scatter_base": (None, False),
    "all_to_all": (None, False), "all_to_all_single": (None, False),
    "gather": ("dst", False), "scatter": ("src", False), "barrier": (None, False),
    "send": ("dst", True), "recv": ("src", True), "isend": ("dst", True), "irecv": ("src", True),
}
_ALWAYS_BLOCKING = {"send", "recv"}
# megazero's own wrappers, checked for host tensors too: an implementation may keep an argument
# out of the backend call on gloo (the all-to-all reduce-scatter sums into ``out`` locally) that
# NCCL's native one passes to it.
_OWN_WRAPPERS = {"megazero.distributed.collectives": ("reduce_scatter", "all_gather")}
_TENSOR_ARGS = ("tensor", "tensor_list", "output", "input", "output_tensor", "input_tensor",
                "output_tensor_list", "input_tensor_list", "input_list", "gather_list",
                "scatter_list", "out", "inp", "shard")
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN = "<own wrapper: checked, not logged>"
_WRAPPER_FILES = tuple(os.path.join("megazero", f) for f in
                       ("collectives.py", "compat.py", os.path.join("zero", "comm.py")))


class NcclRuleError(RuntimeError):
    """A call that NCCL would refuse, or that would time out under NCCL."""


def requested(explicit: bool | None = None) -> bool:
    """Whether a world starting now runs under the mode: ``explicit`` if given, else the env."""
    if explicit is not None:
        return explicit
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def wait_limit(explicit: float | None = None) -> float:
    if explicit is not None:
        return explicit
    return float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"nccl-rules-rank{rank}.log")


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _describe(t: torch.Tensor) -> str:
    """dtype and element count: what NCCL matches (a view of another shape is the same call)."""
    return f"{str(t.dtype).replace('torch.', '')}[{t.numel()}]"


def _caller() -> str:
    """Where the call was made: the first frame outside torch, this module and megazero's
    collective wrappers, as ``file:line (function)``."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR)
                             or f.f_code.co_filename == __file__
                             or f.f_code.co_filename.endswith(_WRAPPER_FILES)):
        f = f.f_back  # type: ignore[assignment]
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


class _Recorder:
    """One rank's wrappers and log."""

    def __init__(self, rank: int, path: str, limit: float) -> None:
        self.rank, self.limit = rank, limit
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by uninstall)
        self.keys: dict[int, tuple[str, list[int]]] = {}
        self.patched: list[tuple[Any, str, Any]] = []
        self.depth = 0

    def check_host(self, name: str, key: str, where: str, bound: dict[str, Any],
                   tensor_args: list[str]) -> None:
        for arg in tensor_args:
            for t in _tensors(bound.get(arg)):
                if host_resident.is_host_resident(t):
                    raise NcclRuleError(
                        f"{name} over ranks [{key}] at {where}: argument '{arg}' "
                        f"({_describe(t)}) is a buffer megazero keeps on the host (offloaded "
                        "master or moment, pinned staging, swap or checkpoint buffer); NCCL "
                        "takes only tensors on the rank's GPU: copy it to the device first "
                        "(or reduce a device tensor and copy the result back)")

    def group(self, group: Any) -> tuple[str, list[int]]:
        g = group if group is not None else c10d._get_default_group()
        got = self.keys.get(id(g))
        if got is None:
            ranks = list(dist.get_process_group_ranks(g))
            got = self.keys[id(g)] = (",".join(map(str, ranks)), ranks)
        return got

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        root_arg, p2p = _OPS.get(name, (_OWN, False))
        # the tensor arguments of the op, in signature order
        tensor_args = [p for p in sig.parameters if p in _TENSOR_ARGS]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # a call made by a wrapped call (a deprecated alias, a fallback)
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs).arguments
            group = bound.get("group")
            key, ranks = self.group(group)
            where = _caller()
            self.check_host(name, key, where, bound, tensor_args)
            if root_arg is _OWN:
                return fn(*args, **kwargs)
            main = next((t for a in tensor_args for t in _tensors(bound.get(a))), None)
            desc = name if main is None else f"{name} {_describe(main)}"
            if main is not None and name == "all_to_all_single" and (
                    bound.get("output_split_sizes") is not None
                    or bound.get("input_split_sizes") is not None):
                # uneven splits: each rank's sizes differ by design (MoE token dispatch);
                # NCCL pairs the calls by order and dtype
                desc = f"{name} {str(main.dtype).replace('torch.', '')}[split]"
            if p2p:
                desc = "p2p" if main is None else f"p2p {_describe(main)}"
                peer = bound.get(root_arg) if root_arg else None
                if peer is None and bound.get(f"group_{root_arg}") is not None:
                    peer = dist.get_global_rank(group or c10d._get_default_group(),
                                                bound[f"group_{root_arg}"])
                src, dst = (self.rank, peer) if root_arg == "dst" else (peer, self.rank)
                key = f"{src}->{dst}"
            elif root_arg is not None:
                root = bound.get(root_arg)
                if root is None and bound.get(f"group_{root_arg}") is not None:
                    root = ranks[bound[f"group_{root_arg}"]]
                desc += f" {root_arg}={root}"
            self.file.write(f"{key}\t{desc}\t{where}\n")
            self.file.flush()
            blocking = name in _ALWAYS_BLOCKING or not bound.get("async_op", False)
            start = time.monotonic()
            self.depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self.depth -= 1
            waited = time.monotonic() - start
            if blocking and waited > self.limit:
                raise NcclRuleError(
                    f"{name} over ranks [{key}] at {where} waited {waited:.2f}s, more than the "
                    f"limit of {self.limit:g}s: a collective must not wait behind work one rank "
                    "does alone (under NCCL it times out after the group's timeout, "
                    "--distributed-timeout-minutes); let every rank compute what it needs, or "
                    "wait outside a collective (poll for a file the rank writes atomically)")
            return out

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = name
        return wrapper

    def install(self) -> None:
        wrappers: dict[int, Any] = {}
        for name in _OPS:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrappers[id(fn)] = self.wrap(name, fn)
        for modname, names in _OWN_WRAPPERS.items():
            own = importlib.import_module(modname)
            for name in names:
                fn = getattr(own, name)
                wrappers[id(fn)] = self.wrap(f"{modname}.{name}", fn)
        # torch's own namespaces, then every megazero module holding a copy of an original
        mods = [dist, c10d] + [m for n, m in list(sys.modules.items())
                               if m is not None and (n == "megazero" or n.startswith("megazero."))]
        for mod in mods:
            for attr, value in list(vars(mod).items()):
                w = wrappers.get(id(value))
                if w is not None:
                    self.patched.append((mod, attr, value))
                    setattr(mod, attr, w)

    def uninstall(self) -> None:
        for mod, attr, value in reversed(self.patched):
            setattr(mod, attr, value)
        self.patched.clear()
        self.file.close()


_active: _Recorder | None = None


def install(rank: int, log_dir: str, limit: float | None = None) -> None:
    """Turn the mode on in this rank (after ``init_process_group``): host-buffer tracking,
    wrapped collectives, the log in ``log_dir``."""
    global _active
    if _active is not None:
        uninstall()
    host_resident.track(True)
    _active = _Recorder(rank, log_path(log_dir, rank), wait_limit(limit))
    _active.install()


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None
    host_resident.track(False)


def active() -> bool:
    return _active is not None


class LogReader:
    """The ranks' logs as they grow: each :meth:`poll` reads only the lines added since the
    last one, so a world can be checked while it runs (a divergence usually ends in a hang)."""

    def __init__(self, log_dir: str, world_size: int) -> None:
        self.paths = [log_path(log_dir, r) for r in range(world_size)]
        self.offsets = [0] * world_size
        self.logs: list[dict[str, list[tuple[str, str]]]] = [{} for _ in range(world_size)]
        self.agreed: dict[str, int] = {}  # key -> entries already found equal on every member

    def poll(self) -> None:
        for r, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self.offsets[r] += end
            for line in data[:end].decode("utf-8").splitlines():
                parts = line.split("\t")
                if len(parts) == 3:
                    self.logs[r].setdefault(parts[0], []).append((parts[1], parts[2]))

    def divergence(self, finished: bool = True) -> str | None:
        """The first place where the members of a group issued different calls, or None.

        Every member of a group (both ends of a point-to-point pair) must have logged the same
        sequence of entries under its key. ``finished``: the ranks are done, so a member that
        logged fewer entries diverges where it stops (a call another rank waits on forever);
        while they run, only two different entries at one index count."""
        self.poll()
        logs = self.logs
        for key in sorted({k for log in logs for k in log}):
            members = [r for r in _members(key) if 0 <= r < len(logs)]
            seqs = {r: logs[r].get(key, []) for r in members}
            longest = max(len(s) for s in seqs.values())
            start = self.agreed.get(key, 0)
            for i in range(start, longest):
                ref_rank = members[0]
                ref = seqs[ref_rank][i] if i < len(seqs[ref_rank]) else None
                for r in members[1:]:
                    got = seqs[r][i] if i < len(seqs[r]) else None
                    if (got and got[0]) == (ref and ref[0]):
                        continue
                    if not finished and (got is None or ref is None):
                        continue
                    return (f"ranks [{key}] diverge at call #{i} of that group: rank "
                            f"{ref_rank} issued {_show(ref)}, rank {r} issued {_show(got)}; "
                            "under NCCL these calls do not pair up (a hang or corrupted data). "
                            "Every collective decision must be the same on every rank.")
            self.agreed[key] = max(start, min(len(s) for s in seqs.values()))
        return None


def _show(e: tuple[str, str] | None) -> str:
    return "nothing (it issued no such call)" if e is None else f"{e[0]} (at {e[1]})"


def _members(key: str) -> list[int]:
    if "->" in key:
        a, b = key.split("->")
        return [int(a), int(b)]
    return [int(r) for r in key.split(",")]


def compare_logs(log_dir: str, world_size: int) -> str | None:
    """The first divergence between the finished ranks' logs in ``log_dir``, or None."""
    return LogReader(log_dir, world_size).divergence()
