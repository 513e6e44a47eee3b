"""The errors megazero raises on purpose, and how a launched job reports them.

Every error that describes a problem the user can fix (a flag, a JSON key, a data file, a
checkpoint, a diverging fp16 run) derives from :class:`MegazeroError` or is listed in
:func:`expected_errors`. ``pretrain_gpt.py`` turns those into ONE line per job,
``pretrain_gpt.py: error: ...``, instead of a Python traceback from every rank. Anything else is
a bug and keeps its traceback.

Who speaks: before the process group exists (flag and JSON errors) every rank computes the same
message, so ``RANK`` 0 prints it. Once the group exists an error may be raised by some ranks only
(a file one node cannot read), so the first failing rank claims the job's error slot in the
launcher's key-value store; rank 0 is given a short head start so that an error every rank hits is
reported by rank 0. The other ranks leave quietly with status 0: the job fails through the one
that spoke, and ``torchrun``'s failure summary names that one rank instead of one block per rank
(see :func:`report_error`).

``MEGAZERO_DEBUG=1`` in the environment prints the full traceback on every rank as well.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping

#: Exit status of a job stopped by an expected error (argparse uses 2 for usage errors too).
EXIT_CODE = 2
DEBUG_ENV = "MEGAZERO_DEBUG"


def attempt_key(name: str, env: Mapping[str, str] = os.environ) -> str:
    """A key in the job's key-value store, unique to this launch attempt: ``torchrun
    --max-restarts`` starts the workers again on the same store (static rendezvous) and a key
    left by the failed attempt (who reported its error, which peer registered) must not be
    read as this attempt's."""
    return f"megazero/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


class MegazeroError(Exception):
    """A problem the user can fix; the message names what was given and the fix."""


class ConfigError(MegazeroError, ValueError):
    """A setting that is wrong; the message names the key, what was given and the fix."""


class DataError(MegazeroError, ValueError):
    """A data file or tokenizer the flags name is missing or unusable."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run (or written); the message says why and
    what to do. A ``RuntimeError``, as the collective errors a failed save may also raise."""


class TopologyError(ValueError):
    """A layout that cannot be built from the sizes given."""


def one_line_warnings(prog: str) -> None:
    """Print every warning as ``prog: warning: ...``, without the file and source line that
    ``warnings.warn`` shows (a user reads the message, not megazero's code)."""
    import warnings

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             line: str | None = None) -> str:
        return f"{prog}: warning: {message}\n"

    warnings.formatwarning = show


def expected_errors() -> tuple[type[BaseException], ...]:
    """The classes reported as one clean line."""
    return (MegazeroError, CheckpointError)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def env_rank() -> int:
    """The launcher's global rank (torchrun ``RANK``, Slurm ``SLURM_PROCID``), 0 without one."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def claim_report(rank: int, head_start_s: float = 0.0, unsure: bool | None = None) -> bool:
    """True if this rank is the one that prints the job's error (first claimant wins).
    ``unsure``: the answer when no store can be asked (default: rank 0 speaks)."""
    unsure = rank == 0 if unsure is None else unsure
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # no store to agree through
        store = None
    if store is None:
        return unsure
    if rank != 0:
        time.sleep(head_start_s)
    try:
        winner = store.compare_set(attempt_key("error-reported-by"), "", str(rank))
        return winner.decode() == str(rank)
    except Exception:
        return unsure


def already_reported() -> bool:
    """True once a rank of this job has reported an expected error. A rank that then fails in a
    collective (its peer has left: "Connection closed by peer") is seeing a consequence, not a
    second problem, and exits without a traceback."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return False
        store = dist.distributed_c10d._get_default_store()
        return bool(store.check([attempt_key("error-reported-by")]))
    except Exception:
        return False


def record_for_launcher(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Write ``message`` where torchrun looks for a child's error (``TORCHELASTIC_ERROR_FILE``,
    the file its ``@record`` decorator writes), so its failure report's "Root Cause" section
    names the error instead of "To enable traceback see: ...". True when written."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w", encoding="utf-8") as f:
            # the layout torch's ErrorHandler writes; torchrun prints ``py_callstack`` as the
            # failure's "traceback", so it carries the one line instead of a stack
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
        return True
    except OSError:
        return False


def report_error(error: BaseException, prog: str, *, head_start_s: float = 1.0,
                 siblings_s: float = 10.0, on_report: Callable[[str], None] | None = None) -> int:
    """Print ``prog: error: <message>`` once per job; return this rank's exit status.

    The speaking rank returns the error's status (and writes it where ``torchrun`` looks, so its
    summary names the error); first it waits up to ``siblings_s`` for the other ranks on its
    node to leave, so the launcher has nobody left to terminate (no "closing signal" lines, no
    failure block per rank). Every other rank returns 0 at once, without a word: the job fails
    through the rank that spoke, with status 2 (``MEGAZERO_DEBUG=1`` prints every rank's
    traceback, and every rank then keeps the error's status).
    """
    rank = env_rank()
    code = getattr(error, "exit_code", EXIT_CODE)
    if debug_enabled():
        traceback.print_exception(error, file=sys.stderr)
    if not claim_report(rank, head_start_s):
        return code if debug_enabled() else 0
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    record_for_launcher(f"{prog}: error: {error}")
    if on_report is not None:  # e.g. kept for the next attempt of a restarted job
        on_report(str(error))
    wait_for_siblings(siblings_s)
    return code


def _siblings() -> list[int]:
    """The other worker processes the launcher started on this node (children of this
    process's parent), when a launcher that starts them from one process (torchrun, DeepSpeed's)
    is known to run this one; [] otherwise or without ``/proc``."""
    if not ({"TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"} & set(os.environ)):
        return []
    parent, me, found = os.getppid(), os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] not in "ZX":
            found.append(int(name))
    return found


def wait_for_siblings(timeout_s: float) -> None:
    """Return once the launcher's other processes on this node have left (or after
    ``timeout_s``: a rank blocked in a collective does not leave by itself)."""
    deadline = time.monotonic() + timeout_s
    while _siblings() and time.monotonic() < deadline:
        time.sleep(0.05)
