"""``tools/check_cluster.py``: what a user runs on a fresh allocation before a long job.

Four kinds of rows, one PASS/FAIL line each (SKIP where a row cannot apply, e.g. collectives
in a world of one), and a non-zero exit on any FAIL:

- device binding (:mod:`.binding`): each rank's device, unique per node, the one its launcher's
  local rank gives (:mod:`megazero.distributed.device`);
- collectives (:mod:`.bandwidth`): the job's all-reduce, reduce-scatter, all-gather, broadcast
  and pipeline send/recv at its sizes, checked for the right values, with nccl-tests' bus
  bandwidth against the link's nominal figure;
- per rank (:mod:`.per_rank`): each rank's compute and link timing against the others, so a
  throttled rank that makes every collective slow is named;
- training (:mod:`.training_rows`): a small GPT for a few iterations at ZeRO 0-3 (bf16 and fp16
  on GPUs, fp32 on CPU) and with the optimizer offloaded to the CPU, saved and resumed, through
  the same setup and loop as ``pretrain_gpt.py``; every layout trains the same model, so its
  losses must equal one rank's run of the same flags, and the resumed losses the
  uninterrupted ones.

Every rank runs every row (the collectives need them all); rank 0 prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("PASS", "FAIL", "SKIP")


@dataclass(frozen=True)
class Row:
    """One line of the table: ``name``, ``status`` (PASS, FAIL or SKIP), a short reason or
    measurement."""

    name: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: expected one of {STATUSES}")


def format_table(rows: list[Row]) -> str:
    width = max((len(r.name) for r in rows), default=0)
    lines = [f"{r.status:4s}  {r.name:{width}s}  {r.detail}" for r in rows]
    failed = sum(r.status == "FAIL" for r in rows)
    lines.append(f"{len(rows)} checks, {failed} failed" if failed else
                 f"{len(rows)} checks, all passed")
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status == "FAIL" for r in rows) else 0
