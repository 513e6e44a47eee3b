"""Compiling the fusion functions, and the one rule for when the fused form runs."""

from __future__ import annotations

import functools
import shutil
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def fuse(fn: F) -> F:
    """``fn`` compiled with ``torch.compile(fullgraph=True, dynamic=True)``, compiled on the
    first call (importing megazero compiles nothing).

    ``fullgraph``: a graph break would silently split the fusion back into eager kernels.
    ``dynamic``: one graph serves every shape (the generation loop's growing sequence, the
    last partial micro-batch), so a shape change neither recompiles nor, past dynamo's cache
    limit, falls back to eager; the kernels are elementwise, where static sizes gain little.
    If compiling fails (no usable compiler or kernel backend), it warns once and runs ``fn``
    eagerly from then on: the same function, unfused.
    """
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(torch.compile(fn, fullgraph=True, dynamic=True))
        try:
            return compiled[0](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - an accelerator must not end the run
            # A build whose compiler cannot take the function (a missing toolchain, an
            # inductor bug): the eager reference computes the same function from now on.
            if compiled[0] is fn:
                raise
            warnings.warn(f"fused {fn.__name__} could not be compiled "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          "running it unfused", stacklevel=2)
            compiled[0] = fn
            return fn(*args, **kwargs)

    run.eager = fn  # type: ignore[attr-defined]  # the reference, for tests
    return run  # type: ignore[return-value]


def use_fusion(enabled: bool, x: torch.Tensor, on_cpu: bool = False) -> bool:
    """Whether the fused form runs for activation ``x``: the model's switch is on, and ``x`` is
    on CUDA (where inductor emits Triton kernels that save memory passes) or ``on_cpu`` asks for
    it (CPU tests of the fused path; on CPU it is not faster). Under ``torch.compile`` of a
    whole model (or of a layer) the caller's compiler fuses already: the eager form is traced."""
    if not enabled or torch.compiler.is_compiling():
        return False
    if x.is_cuda:
        return triton_available()
    return on_cpu and x.device.type == "cpu"


@functools.cache
def triton_available() -> bool:
    """Whether inductor can build GPU kernels (Triton, shipped with torch's CUDA wheels). Without
    it the fusions stay eager rather than fail at the first step."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - a torch without the helper
        return False
    return bool(has_triton())


def compiler_available() -> str | None:
    """None when inductor can build CPU kernels here, else why not (inductor compiles C++ for
    the CPU and needs a compiler on PATH)."""
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return None
    return "no C++ compiler (g++, c++ or clang++) on PATH: inductor cannot build CPU kernels"
