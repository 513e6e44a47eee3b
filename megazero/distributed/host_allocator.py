"""Host memory for training on the CPU: keep what an iteration frees for the next one.

PyTorch's CPU allocator takes every tensor from ``malloc``. glibc serves blocks above its mmap
threshold (128 KiB at start, raised on the fly up to 32 MiB by the largest mmap'd block freed)
with fresh pages from the kernel, and gives the top of its heap back once more than twice the
threshold is free there. A training iteration frees its activations at the end, so with the
defaults the next iteration may get fresh pages again: each one is a page fault plus the kernel
zeroing it. How often depends on what else the process happens to free (a ZeRO stage 1
reduce-scatter's temporaries raise the threshold, stage 0's in-place all-reduce does not):
``pretrain_gpt.py`` with the ``bench/zero_speed.py`` model at stage 0 took 5,900 minor faults
(23 MiB of fresh pages) per iteration, stage 1 1,200, and forward ran 5-10% slower at stage 0.

:func:`keep_freed_host_memory` fixes the threshold at glibc's maximum (32 MiB: larger blocks
still come from mmap and go back at free) and the trim threshold at 1 GiB, so what an iteration
frees stays in the heap for the next: about 60 faults per iteration at any stage. The price is
that the process keeps its peak heap (up to 1 GiB above what it holds) instead of returning it,
as a caching allocator would. The training entry points call it when the model runs on the CPU.

Nothing is changed when the user has chosen themselves: a ``MALLOC_*`` tuning variable in the
environment (glibc read it at start), another allocator preloaded (jemalloc, tcmalloc,
mimalloc), ``MEGAZERO_HOST_ALLOCATOR=system``, or a C library without ``mallopt`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 1024 * 1024 * 1024

USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
               "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def reason_to_leave_alone(env: Mapping[str, str] = os.environ) -> str | None:
    """Why the allocator is not to be tuned in this process, or None."""
    if env.get("MEGAZERO_HOST_ALLOCATOR", "") == "system":
        return "MEGAZERO_HOST_ALLOCATOR=system"
    for name in USER_TUNING:
        if name in env:
            return f"{name} is set"
    preload = env.get("LD_PRELOAD", "")
    for lib in OTHER_ALLOCATORS:
        if lib in preload:
            return f"{lib} is preloaded"
    return None


def keep_freed_host_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Tune glibc's malloc as the module docstring says; True when it was done."""
    if reason_to_leave_alone(env) is not None:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; setting either value turns glibc's adjustment off.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
