"""The collectives whose implementation depends on the backend, and the rule that picks it.

Tensor parallelism (:mod:`megazero.tensor_parallel.mappings`) and the ZeRO engine
(:mod:`megazero.distributed.group_comm`) both reduce-scatter and all-gather flat tensors; both call
this module, so one table says which backend does what natively:

* **reduce-scatter** (``reduce_scatter_impl``): ``"native"`` is the backend's own
  reduce-scatter into one tensor; ``"all_to_all"`` sends chunk ``r`` to rank ``r`` and sums what
  arrives (the same bytes as a ring reduce-scatter, one extra input-sized receive buffer);
  ``"all_reduce"`` all-reduces a copy and keeps this rank's slice (exact, twice the bytes).
  ``"auto"`` is ``all_to_all`` on gloo, whose native reduce-scatter is an all-reduce underneath
  (twice the bytes; measured in ``bench/zero_speed.py``), and ``native`` elsewhere.
* **all-gather into one tensor**: native everywhere the table says so, else one all-gather
  into per-rank views of the output.

The choice is made once, from the backend name and the torch version (:func:`has_native`),
never by calling a collective and catching its error: an exception from a collective is a real
error (mismatched shapes or dtypes, a dead peer) and reaches the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megazero.distributed.compat import TORCH_VERSION, all_gather_into_tensor, reduce_scatter_tensor

Group = ProcessGroup | None

REDUCE_SCATTER_IMPLS = ("auto", "native", "all_to_all", "all_reduce")

# (backend, op) -> the oldest torch in which that backend has the op natively. Backends not
# listed (nccl, and accelerators' own) are taken to have every op.
_GLOO_NATIVE_SINCE: dict[str, tuple[int, int]] = {
    # ProcessGroupGloo::_reduce_scatter_base: synchronous from 2.2, asynchronous from 2.3.
    "reduce_scatter_tensor": (2, 3),
    "all_gather_into_tensor": (2, 2),
    "all_to_all_single": (1, 0),
}
_NATIVE_SINCE: dict[str, dict[str, tuple[int, int]]] = {"gloo": _GLOO_NATIVE_SINCE}
# Backends whose all-gather accepts this rank's shard as a view into the output tensor.
_INPLACE_ALL_GATHER = frozenset({"gloo", "nccl"})


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def backend_of(group: Group) -> str:
    """The group's backend name, lower case ("" for no group or no process group)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return ""
    return str(dist.get_backend(group)).lower()


def has_native(op: str, backend: str, torch_version: tuple[int, ...] = TORCH_VERSION) -> bool:
    """Whether ``backend`` implements ``op`` itself in this torch."""
    since = _NATIVE_SINCE.get(backend, {}).get(op)
    return since is None or torch_version >= since


def all_gather_accepts_view(backend: str) -> bool:
    return backend in _INPLACE_ALL_GATHER


def reduce_scatter_impl(requested: str, backend: str,
                        torch_version: tuple[int, ...] = TORCH_VERSION) -> str:
    """The reduce-scatter implementation to use on ``backend`` (see the module docstring)."""
    if requested not in REDUCE_SCATTER_IMPLS:
        raise ValueError(f"reduce_scatter_impl {requested!r}: expected one of "
                         f"{', '.join(REDUCE_SCATTER_IMPLS)}")
    if requested == "auto":
        requested = "all_to_all" if backend == "gloo" else "native"
    if requested == "native" and not has_native("reduce_scatter_tensor", backend, torch_version):
        requested = "all_to_all"
    if requested == "all_to_all" and not has_native("all_to_all_single", backend, torch_version):
        requested = "all_reduce"
    return requested


@dataclass
class Issued:
    """A collective in flight and the local work that completes it.

    ``op`` names the collective actually issued and ``wire_factor`` its bytes relative to a
    ring reduce-scatter / all-gather of the same tensor (2 for all-reduce + slice), for the
    byte accounting of :class:`megazero.distributed.group_comm.CommLog`.
    """

    work: Any
    finish: Callable[[], object] | None
    op: str
    wire_factor: float = 1.0
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        if self.finish is not None:
            self.finish()
        self.done = True


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, impl: str,
                   async_op: bool = False) -> Issued:
    """``out`` (contiguous, numel B/N) receives this rank's summed chunk of ``inp`` (contiguous,
    numel B, chunk ``r`` = elements ``[r*B/N, (r+1)*B/N)``). ``impl`` is a resolved name from
    :func:`reduce_scatter_impl`. Waits before returning unless ``async_op``."""
    n = group_size(group)
    if inp.numel() != n * out.numel():
        raise ValueError(f"reduce-scatter over {n} ranks: input has {inp.numel()} elements, "
                         f"output {out.numel()}; the input must be {n} times the output")
    if impl == "native":
        work = reduce_scatter_tensor(out, inp, group=group, async_op=async_op)
        issued = Issued(work, None, "reduce_scatter")
    elif impl == "all_to_all":
        recv = torch.empty_like(inp)
        work = dist.all_to_all_single(recv, inp, group=group, async_op=async_op)

        def finish() -> None:
            torch.sum(recv.view(n, -1), dim=0, out=out.view(-1))

        issued = Issued(work, finish, "all_to_all")
    elif impl == "all_reduce":
        tmp = inp.clone()
        work = dist.all_reduce(tmp, group=group, async_op=async_op)
        k, r = out.numel(), group_rank(group)
        issued = Issued(work, lambda: out.view(-1).copy_(tmp.view(-1)[r * k:(r + 1) * k]),
                        "all_reduce", 2.0)
    else:
        raise ValueError(f"reduce_scatter impl {impl!r}: expected native, all_to_all or "
                         "all_reduce (resolve 'auto' with reduce_scatter_impl)")
    if not async_op:
        issued.wait()
    return issued


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Group,
               async_op: bool = False) -> Any:
    """Fill ``out`` (numel N*S, rank-major) from every rank's ``shard`` (numel S); returns the
    backend's work handle (None when it already finished)."""
    n = group_size(group)
    if out.numel() != n * shard.numel():
        raise ValueError(f"all-gather over {n} ranks: shard has {shard.numel()} elements, "
                         f"output {out.numel()}; the output must be {n} times the shard")
    if has_native("all_gather_into_tensor", backend_of(group)):
        return all_gather_into_tensor(out, shard, group=group, async_op=async_op)
    return dist.all_gather(list(out.view(n, -1).unbind(0)), shard.reshape(-1), group=group,
                           async_op=async_op)
