"""``--split 969,30,1``: train/valid/test document ranges, with Megatron's rounding."""

from __future__ import annotations

import re

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"0.9/0.1"``) -> three weights normalised to sum 1.

    Missing trailing parts are zero, as in Megatron.
    """
    parts = [p for p in re.split(r"[,/]", split.strip()) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 numbers such as 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected 1 to 3 non-negative numbers with a positive "
                         "sum, such as 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(split: str | list[float], num_documents: int) -> list[tuple[int, int]]:
    """Half-open document ranges ``[(b0, e0), (b1, e1), (b2, e2)]`` for train, valid, test.

    Megatron's rule: each boundary is the running sum of ``round(weight * n)``, then all
    boundaries are shifted by the rounding surplus so the last one is exactly ``n`` (the surplus
    or deficit lands on the first split).
    """
    weights = parse_split(split) if isinstance(split, str) else list(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]
