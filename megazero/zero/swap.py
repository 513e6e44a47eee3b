"""Swap files for NVMe offload: asynchronous reads and writes through a small thread pool.

A request on a tensor is cut into ``aio.block_size`` pieces handed to
``aio.intra_op_parallelism x aio.queue_depth`` threads, each doing ``os.preadv`` /
``os.pwritev`` straight into the tensor's memory (the syscalls release the GIL, so the threads
overlap with the optimizer's compute). Files are opened with ``O_DIRECT`` where the file system
allows it, so the bytes move between the disk and the buffer without the page cache; regions and
buffers are then :data:`~megazero.zero.offload.ALIGN_BYTES`-aligned, as ``O_DIRECT`` requires.

:class:`OptimizerSwapper` holds the fp32 masters and Adam moments of one rank in three files and
streams them through ``buffer_count // 3`` host slots, one sub-group per slot: it reads the next
sub-group while the current one is updated and writes the previous one behind. Host memory is
those slots, whatever the size of the optimizer state.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megazero.config import AioConfig, ConfigError, ZeroConfig
from megazero.zero.offload import (
    OPTIMIZER_STATES,
    aligned_host_empty,
    aligned_numel,
    buffer_count,
    swap_dir,
)


class Pending:
    """Requests in flight for one tensor; :meth:`wait` re-raises the first I/O error."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        for f in self.futures:
            f.result()


class SwapIO:
    """Open swap files and move bytes between them and host tensors; counts what it moves."""

    def __init__(self, aio: AioConfig) -> None:
        self.block = aligned_numel(aio.block_size, 1)
        self.threads = max(1, min(64, aio.intra_op_parallelism * aio.queue_depth))
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="megazero-swap")
        self.bytes_read = 0
        self.bytes_written = 0
        self._fds: list[int] = []
        self._paths: list[str] = []
        weakref.finalize(self, SwapIO._close, self.pool, self._fds, self._paths)

    def open(self, path: str, nbytes: int, direct: bool = True, key: str = "nvme_path"
             ) -> tuple[int, bool]:
        """A new file of ``nbytes`` (space reserved now, so a full disk fails here, not mid-run:
        ConfigError naming ``key``); returns (fd, opened with O_DIRECT)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        fd, used = -1, False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd, used = os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError:
                fd = -1
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(1, nbytes))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                raise ConfigError(f"{key}: no space left for a {nbytes}-byte swap file at "
                                  f"{path} (other ranks or jobs filled the disk); free space "
                                  f"there or point nvme_path at a larger disk") from None
            os.ftruncate(fd, nbytes)  # file systems without fallocate: sparse file
        except AttributeError:
            os.ftruncate(fd, nbytes)
        self._fds.append(fd)
        self._paths.append(path)
        return fd, used

    def read(self, fd: int, tensor: torch.Tensor, offset: int) -> Pending:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self._submit(fd, tensor, offset, write=False)

    def write(self, fd: int, tensor: torch.Tensor, offset: int) -> Pending:
        self.bytes_written += tensor.numel() * tensor.element_size()
        return self._submit(fd, tensor, offset, write=True)

    def _submit(self, fd: int, tensor: torch.Tensor, offset: int, write: bool) -> Pending:
        view = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
        futures = []
        for lo in range(0, len(view), self.block):
            chunk = view[lo:lo + self.block]
            futures.append(self.pool.submit(_pio, fd, chunk, offset + lo, write))
        return Pending(futures)

    @staticmethod
    def _close(pool: ThreadPoolExecutor, fds: list[int], paths: list[str]) -> None:
        pool.shutdown(wait=True)
        for fd in fds:
            os.close(fd)
        for path in paths:
            try:
                os.remove(path)
            except OSError:
                pass


def _pio(fd: int, chunk: memoryview, offset: int, write: bool) -> None:
    done = 0
    while done < len(chunk):
        part = chunk[done:]
        n = (os.pwritev(fd, [part], offset + done) if write
             else os.preadv(fd, [part], offset + done))
        if n <= 0:
            raise OSError(f"swap file {'write' if write else 'read'} stopped at byte "
                          f"{offset + done} (returned {n})")
        done += n


class OptimizerSwapper:
    """fp32 master, exp_avg and exp_avg_sq of each sub-group, in three files under ``directory``.

    ``numels[g]`` is sub-group g's element count; its region in each file starts at an aligned
    byte offset. ``slots`` host buffers hold one sub-group's three states each.
    """

    def __init__(self, numels: list[int], directory: str, io: SwapIO, slots: int,
                 pin: bool) -> None:
        self.io = io
        self.numels = numels
        self.offsets, pos = [], 0
        for n in numels:
            self.offsets.append(pos)
            pos += aligned_numel(n, 4) * 4
        self.file_bytes = pos
        self.width = aligned_numel(max(numels, default=1), 4)
        self.files = [io.open(os.path.join(directory, f"{name}.swp"), pos,
                              key="zero_optimization.offload_optimizer.nvme_path")[0]
                      for name in ("master", "exp_avg", "exp_avg_sq")]
        self.slots = [aligned_host_empty(OPTIMIZER_STATES * self.width, torch.float32, pin)
                      .view(OPTIMIZER_STATES, self.width)
                      for _ in range(max(1, min(slots, len(numels))))]
        #: every host buffer byte this swapper allocated for streaming (tests bound it)
        self.allocated_bytes = sum(s.untyped_storage().nbytes() for s in self.slots)
        self.last_stream: dict[str, float] = {}

    def _io(self, g: int, buf: torch.Tensor, write: bool) -> Pending:
        n = aligned_numel(self.numels[g], 4)
        pend = [(self.io.write if write else self.io.read)(fd, buf[i, :n], self.offsets[g])
                for i, fd in enumerate(self.files)]
        return Pending([f for p in pend for f in p.futures])

    def stream(self, fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None],
               read: bool = True, write: bool = True) -> None:
        """Call ``fn(g, master, exp_avg, exp_avg_sq)`` for every sub-group in order, with views
        of a slot holding its states (read from the files first when ``read``), writing them
        back afterwards when ``write``. Slots rotate: with S slots, S - 2 sub-groups are read
        ahead while one is written behind (S = 2: one ahead, none behind; S = 1: in turn).

        ``last_stream`` then holds the bytes read and written, ``seconds`` (wall time from the
        first read issued to the last write completed) and ``io_wait_seconds`` (time this
        thread spent blocked on a read or on a slot's pending write): their ratio near 1 means
        the disk bounds the stream, near 0 the update does."""
        count, nslots = len(self.numels), len(self.slots)
        ahead = nslots - 2 if nslots >= 3 else nslots - 1
        reads: dict[int, Pending] = {}
        writes: list[Pending | None] = [None] * nslots
        r0, w0, t0, waited = self.io.bytes_read, self.io.bytes_written, time.perf_counter(), 0.0

        def claim(k: int) -> None:
            nonlocal waited
            s = k % nslots
            pending = writes[s]
            if pending is not None:
                t = time.perf_counter()
                pending.wait()
                waited += time.perf_counter() - t
                writes[s] = None
            reads[k] = self._io(k, self.slots[s], write=False) if read else Pending([])

        for g in range(count):
            for k in range(g, min(count, g + ahead + 1)):
                if k not in reads:
                    claim(k)
            t = time.perf_counter()
            reads.pop(g).wait()
            waited += time.perf_counter() - t
            buf, n = self.slots[g % nslots], self.numels[g]
            fn(g, buf[0, :n], buf[1, :n], buf[2, :n])
            if write:
                writes[g % nslots] = self._io(g, buf, write=True)
        t = time.perf_counter()
        for w in writes:
            if w is not None:
                w.wait()
        waited += time.perf_counter() - t
        self.last_stream = {"seconds": time.perf_counter() - t0, "io_wait_seconds": waited,
                            "bytes_read": self.io.bytes_read - r0,
                            "bytes_written": self.io.bytes_written - w0}

    def load_all(self) -> list[torch.Tensor]:
        """Every sub-group's states in fresh host tensors ``(3, numel)`` (for checkpoints)."""
        out = []
        for g, n in enumerate(self.numels):
            buf = aligned_host_empty(OPTIMIZER_STATES * aligned_numel(n, 4), torch.float32,
                                     False).view(OPTIMIZER_STATES, -1)
            self._io(g, buf, write=False).wait()
            out.append(buf)
        return out

    def store_all(self, bufs: list[torch.Tensor]) -> None:
        pend = [self._io(g, buf, write=True) for g, buf in enumerate(bufs)]
        for p in pend:
            p.wait()


def rank_of_process() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def make_swap_dir(zero: ZeroConfig, block: str, need_bytes: int, kind: str) -> str:
    """A fresh directory for one swapper's files (two engines in one process never share
    files), under ``nvme_path/megazero_swap/rank{r}/``; removed when the process ends."""
    base = swap_dir(block, getattr(zero, block).nvme_path, rank_of_process(), need_bytes, kind)
    path = tempfile.mkdtemp(prefix=f"{kind}-", dir=base)
    weakref.finalize(_DIRS, shutil.rmtree, path, True)
    return path


def optimizer_swapper(zero: ZeroConfig, numels: list[int]) -> OptimizerSwapper:
    """The swapper ``MasterParams`` streams through, after checking the disk can hold it."""
    need = OPTIMIZER_STATES * 4 * sum(aligned_numel(n, 4) for n in numels)
    directory = make_swap_dir(zero, "offload_optimizer", need, "optimizer")
    slots = buffer_count(zero, "offload_optimizer") // OPTIMIZER_STATES
    return OptimizerSwapper(numels, directory, SwapIO(zero.aio), slots,
                            zero.offload_optimizer.pin_memory)


class _Dirs:
    pass


_DIRS = _Dirs()  # swap directories live as long as the process
