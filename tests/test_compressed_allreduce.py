"""The 1-bit compressed all-reduce (megazero.optim.compressed) over 4 gloo ranks under NCCL's
rules: each call equals the algorithm simulated on one process from all ranks' inputs (signs,
per-chunk scales, worker and server error feedback), the error feedback keeps the running sum
of the outputs equal to the running sum of the true averages minus the buffers' residue (an
identity), and each call sends 1/32 of an fp32 ring all-reduce in signs plus 8 (d - 1) bytes of
scales."""

import math

import pytest
import torch

from megazero.optim.compressed import (
    CompressedAllReduce,
    error_buffers,
    pack_signs,
    padded_numel,
    unpack_signs,
)
from megazero.testing import run_distributed

SIZES = (1000, 37, 64)  # not a multiple of 8 x world, tiny, exact
CALLS = 6


def _inputs(rank, n, t):
    g = torch.Generator().manual_seed(1000 * rank + 10 * n + t)
    return torch.randn(n, generator=g) * (1 + rank)


def simulate(world, n, calls):
    """One process plays every worker and server: the scheme written out per chunk."""
    padded = padded_numel(n, world)
    chunk = padded // world
    we = [torch.zeros(padded) for _ in range(world)]
    se = [torch.zeros(chunk) for _ in range(world)]
    outs = []
    for t in range(calls):
        sent = []
        for r in range(world):
            b = we[r].clone()
            b[:n] += _inputs(r, n, t)
            q = torch.empty(padded)
            for j in range(world):
                part = b[j * chunk:(j + 1) * chunk]
                scale = part.norm() / math.sqrt(chunk)
                q[j * chunk:(j + 1) * chunk] = scale * torch.where(part >= 0, 1.0, -1.0)
            we[r] = b - q
            sent.append(q)
        out = torch.empty(padded)
        for j in range(world):
            c = sum(q[j * chunk:(j + 1) * chunk] for q in sent) / world + se[j]
            s = c.norm() / math.sqrt(chunk)
            out[j * chunk:(j + 1) * chunk] = s * torch.where(c >= 0, 1.0, -1.0)
            se[j] = c - out[j * chunk:(j + 1) * chunk]
        outs.append(out[:n])
    return outs, we, se


def _world(rank, world_size):
    op = CompressedAllReduce(None)
    res = {}
    for n in SIZES:
        we, se = error_buffers(n, world_size, torch.device("cpu"))
        outs, identity = [], 0.0
        total_out, total_true = torch.zeros(n), torch.zeros(n)
        op.reset_bytes()
        for t in range(CALLS):
            x = _inputs(rank, n, t).reshape(-1, 1) if n == 64 else _inputs(rank, n, t)
            op(x, we, se)
            outs.append(x.reshape(-1).tolist())  # plain lists cross the result queue
            total_out += x.reshape(-1)
            total_true += sum(_inputs(r, n, t) for r in range(world_size)) / world_size
        # sum of outputs = sum of true means - mean of worker errors - server errors (gathered)
        we_all = [torch.zeros_like(we) for _ in range(world_size)]
        se_all = [torch.zeros_like(se) for _ in range(world_size)]
        torch.distributed.all_gather(we_all, we)
        torch.distributed.all_gather(se_all, se)
        residue = (sum(we_all) / world_size + torch.cat(se_all))[:n]
        identity = (total_out - (total_true - residue)).abs().max().item()
        res[n] = (outs, identity, op.sign_bytes, op.scale_bytes, op.fp32_bytes)
    return res


def test_pack_unpack_roundtrip():
    x = torch.randn(64)
    x[3] = 0.0  # sign(0) is +1
    signs = unpack_signs(pack_signs(x))
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))
    assert pack_signs(x).dtype == torch.uint8 and pack_signs(x).numel() == 8


def test_compressed_allreduce_matches_simulation_and_sends_one_bit():
    world = 4
    results = run_distributed(_world, world, timeout=120, nccl_rules=True)
    for n in SIZES:
        ref, _, _ = simulate(world, n, CALLS)
        for rank_res in results:
            outs, identity, sign_b, scale_b, fp32_b = rank_res[n]
            for t, (a, b) in enumerate(zip(outs, ref)):
                torch.testing.assert_close(torch.tensor(a), b, rtol=1e-5, atol=1e-6,
                                           msg=f"n {n} call {t}")
            assert identity < 1e-4, (n, identity)
            padded = padded_numel(n, world)
            assert sign_b == pytest.approx(fp32_b / 32 * padded / n)
            assert scale_b == CALLS * 8 * (world - 1)
    _, _, _, _, fp32_b = results[0][1000]
    sign_b, scale_b = results[0][1000][2:4]
    # n = 1000 pads to 1024: within 5% of 1/32 of fp32 plus the scales
    assert abs(sign_b + scale_b - (fp32_b / 32 + scale_b)) / (fp32_b / 32) < 0.05
