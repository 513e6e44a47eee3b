"""The 1-bit compressed all-reduce with error feedback (Tang et al. 2021, "1-bit Adam";
DeepSpeed's ``compressed_allreduce``), for the 1-bit optimizers' momentum exchange.

Averaging a tensor x of n elements over d ranks (every rank calls with the same n)::

    phase 1 (worker): b = pad(x) + worker_error, cut into d chunks (chunk j goes to rank j);
        chunk j is sent as its signs (1 bit each, packed 8 per byte) and one scale
        s_j = ||b_j|| / sqrt(len b_j); worker_error = b - s * sign(b)   (all_to_all_single)
    server (rank j): c = mean over ranks r of s_r * sign_r(chunk j) + server_error;
        sent as sign(c) and S = ||c|| / sqrt(len c); server_error = c - S * sign(c)
    phase 2: every rank gathers every server's signs and scale                 (all_gather)
        and the result is S_j * sign(c_j) for each chunk j, unpadded.

sign(0) is +1 (a bit cannot say 0), as in DeepSpeed. Each rank sends (d-1)/d of n/8 bytes in
each phase: 2 (d-1)/d * n/8 bytes, 1/32 of a ring all-reduce of fp32 (2 (d-1)/d * 4n), plus the
scales (d - 1 floats sent in phase 1, 1 in phase 2). The error buffers carry what the signs lost
into the next call, so the average of many calls converges to the average of the inputs.

Written to NCCL's rules: every tensor sent or received lives on ``device`` (the caller's
tensor's device), and every rank passes the same shapes (n and d fix them). The error buffers
belong to the rank and the dp size: a different dp size cannot reuse them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as bits, 8 per uint8 (most significant first); ``x.numel() % 8 == 0``."""
    bits = (x >= 0).reshape(-1, 8).to(torch.uint8)
    return (bits * _BITS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_signs` as +1.0 / -1.0 (float32)."""
    bits = (packed.reshape(-1, 1) & _BITS.to(packed.device)) != 0
    return bits.reshape(-1).to(torch.float32) * 2.0 - 1.0


def padded_numel(n: int, world: int) -> int:
    """n rounded up so that each of ``world`` chunks holds a whole number of bytes of signs."""
    unit = 8 * world
    return max(unit, math.ceil(n / unit) * unit)


def error_buffers(n: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (worker_error, server_error) for a tensor of ``n`` elements over ``world`` ranks."""
    padded = padded_numel(n, world)
    return (torch.zeros(padded, dtype=torch.float32, device=device),
            torch.zeros(padded // world, dtype=torch.float32, device=device))


def _scale(x: torch.Tensor) -> torch.Tensor:
    """Per row: the RMS, the scale that keeps a row's norm when it is replaced by its signs."""
    norm: torch.Tensor = torch.linalg.vector_norm(x, dim=-1)
    return norm / math.sqrt(x.shape[-1])


def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(torch.float32)


class CompressedAllReduce:
    """Averages tensors over ``group`` with :func:`compressed_allreduce`; counts the bytes this
    rank sends (``sent_bytes``, since the last :meth:`reset_bytes`), split into signs and
    scales, for the per-step log and the bandwidth check."""

    def __init__(self, group: Any, log: Any = None, name: str = "dp") -> None:
        """``log``: a :class:`megazero.distributed.group_comm.CommLog` that records each call's
        bytes as ``<name>/compressed_allreduce`` (the engine's per-step communication report)."""
        self.group, self.log, self.name = group, log, name
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.sign_bytes = 0.0
        self.scale_bytes = 0.0
        self.fp32_bytes = 0.0  # what a ring all-reduce of the same fp32 tensors would send

    def reset_bytes(self) -> None:
        self.sign_bytes = self.scale_bytes = self.fp32_bytes = 0.0

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, worker_error: torch.Tensor,
                 server_error: torch.Tensor) -> None:
        """Replace ``x`` (float32, any shape) by its compressed average over the group, updating
        the error buffers (from :func:`error_buffers`) in place."""
        d, n = self.world, x.numel()
        if d == 1:
            return
        padded = worker_error.numel()
        chunk = padded // d
        assert padded == padded_numel(n, d) and server_error.numel() == chunk, \
            "error buffers were made for another size or dp size"
        dev = x.device
        buf = worker_error.clone()
        buf[:n] += x.reshape(-1)
        rows = buf.view(d, chunk)
        scales = _scale(rows)  # (d,): one per destination chunk
        sent = _signs(rows)
        worker_error.copy_(buf - (scales[:, None] * sent).reshape(-1))
        # phase 1: chunk j's signs and scale to rank j
        recv_signs = torch.empty(d, chunk // 8, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv_signs, pack_signs(rows).view(d, chunk // 8),
                               group=self.group)
        recv_scales = torch.empty(d, dtype=torch.float32, device=dev)
        dist.all_to_all_single(recv_scales, scales.contiguous(), group=self.group)
        # server: average this rank's chunk over the workers, with its own error feedback
        got = unpack_signs(recv_signs).view(d, chunk) * recv_scales[:, None]
        c = got.mean(dim=0) + server_error
        s = _scale(c.view(1, -1))
        server_error.copy_(c - s * _signs(c))
        # phase 2: every server's signs and scale to every rank
        all_signs = [torch.empty(chunk // 8, dtype=torch.uint8, device=dev) for _ in range(d)]
        dist.all_gather(all_signs, pack_signs(c), group=self.group)
        all_scales = [torch.empty(1, dtype=torch.float32, device=dev) for _ in range(d)]
        dist.all_gather(all_scales, s.reshape(1), group=self.group)
        out = unpack_signs(torch.cat(all_signs)).view(d, chunk) * torch.cat(all_scales)[:, None]
        x.copy_(out.reshape(-1)[:n].view_as(x))
        frac = (d - 1) / d
        sign_b, scale_b = 2 * frac * padded / 8, 8.0 * (d - 1)  # scales: d - 1 in each phase
        self.sign_bytes += sign_b
        self.scale_bytes += scale_b
        self.fp32_bytes += 2 * frac * 4 * n
        if self.log is not None:
            self.log.record(self.name, "compressed_allreduce", sign_b + scale_b,
                            "compressed_allreduce", sign_b + scale_b)


class PhasedOptimizer(torch.optim.Optimizer):
    """What the 1-bit optimizers share: the step count their phase (warm-up, compressed) is
    decided from, and Adam's moments created on a parameter's first step."""

    def _steps_done(self) -> int:
        """Steps taken so far (every parameter has taken the same number)."""
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
        return 0

    @staticmethod
    def init_moments(st: dict[str, Any], p: torch.Tensor) -> bool:
        """Create ``step``, ``exp_avg`` and ``exp_avg_sq`` on the first step; True if it did."""
        if "exp_avg" in st:
            return False
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(p)
        st["exp_avg_sq"] = torch.zeros_like(p)
        return True

