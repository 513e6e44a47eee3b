"""The README's code map names only paths that exist."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code_map() -> list[tuple[str, str]]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text[text.index("## Code map"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    rows, entry = [], ""
    for line in block.strip("\n").splitlines():
        if not line.startswith(" "):
            entry, line = line.split(None, 1)[0], line[len(line.split(None, 1)[0]):]
        rows.append((entry, line))
    return rows


def test_code_map_paths_exist():
    rows = _code_map()
    assert {"megazero/config/", "megazero/zero/", "megazero/errors.py", "megazero/distributed/",
            "megazero/observability/", "megazero/training/", "megazero/checkpoint/",
            "megazero/testing/"} <= {e for e, _ in rows}
    missing = []
    for entry, text in rows:
        if not os.path.exists(os.path.join(ROOT, entry)):
            missing.append(entry)
        base = entry if entry.endswith("/") else os.path.dirname(entry)
        for name in re.findall(r"[\w/]+\.py\b", text):
            if not any(os.path.exists(os.path.join(ROOT, d, name))
                       for d in (base, "megazero", "")):
                missing.append(f"{name} ({entry})")
    assert not missing, missing
