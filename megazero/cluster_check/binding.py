"""The device-binding row: every rank reports where it runs, rank 0 judges the whole job.

On GPUs a rank must drive the device its launcher's local rank gives it
(:func:`megazero.distributed.device.choose_device_index`), and no two ranks of one node may drive
the same physical GPU (compared by UUID, so per-process ``CUDA_VISIBLE_DEVICES`` binding, where
every rank sees "cuda:0", is judged by the GPU itself). On CPU (gloo) the ranks of a node must have
distinct local ranks.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from megazero.cluster_check import Row
from megazero.config import ConfigError
from megazero.distributed.device import choose_device_index, read_launch


def local_record(device: torch.device) -> dict[str, Any]:
    """What this rank knows about its own binding."""
    launch = read_launch(os.environ)
    rec: dict[str, Any] = {"host": socket.gethostname(), "rank": dist.get_rank(),
                           "local_rank": None if launch is None else launch.local_rank,
                           "device": str(device), "gpu": None, "expected": None, "error": None}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        rec["gpu"] = str(getattr(props, "uuid", None) or f"{props.name}/{index}")
        rec["device"] = f"cuda:{index} ({props.name})"
        try:
            rec["expected"] = choose_device_index(os.environ, torch.cuda.device_count(),
                                                  dist.get_rank())
            rec["index"] = index
        except ConfigError as e:
            rec["error"] = str(e)
    return rec


def judge(records: list[dict[str, Any]]) -> Row:
    """The row for every rank's record (pure: tested with made-up records)."""
    problems = [f"rank {r['rank']}: {r['error']}" for r in records if r["error"]]
    problems += [f"rank {r['rank']} on {r['device']} but its local rank "
                 f"{r['local_rank']} gives cuda:{r['expected']}" for r in records
                 if r["gpu"] is not None and r["expected"] is not None
                 and r.get("index") != r["expected"]]
    seen: dict[tuple[str, Any], int] = {}
    for r in records:
        key = (r["host"], r["gpu"] if r["gpu"] is not None else ("local", r["local_rank"]))
        if key[1] == ("local", None):
            continue  # the launcher does not say; nothing to compare
        if key in seen:
            what = f"GPU {r['gpu']}" if r["gpu"] is not None else f"local rank {r['local_rank']}"
            problems.append(f"ranks {seen[key]} and {r['rank']} share {what} on {r['host']}")
        seen[key] = r["rank"]
    hosts = sorted({r["host"] for r in records})
    if problems:
        return Row("device binding", "FAIL", "; ".join(problems[:4]))
    kinds = sorted({r["device"].split(" ")[-1].strip("()") for r in records})
    return Row("device binding", "PASS",
               f"{len(records)} rank(s) on {len(hosts)} node(s), one device each ("
               f"{', '.join(kinds)})")


def binding_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per rank, for the table's preamble."""
    return [f"  rank {r['rank']:4d}  {r['host']}  local rank {r['local_rank']}  {r['device']}"
            for r in records]


def binding_row(device: torch.device) -> tuple[Row, list[str]]:
    """Collective: gather every rank's record; the row (judged alike on every rank)."""
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, local_record(device))
    return judge(records), binding_lines(records)
