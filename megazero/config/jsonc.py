"""Reading DeepSpeed JSON config files as users write them: with comments, and with clear errors.

Tutorial configs are pasted with ``//`` and ``/* */`` comments, which strict JSON rejects. The
comments are blanked out (replaced by spaces, newlines kept) by a small tokenizer that knows about
strings, so ``"output_path": "http://x"`` survives and every error still points at the line and
column of the original text.

DeepSpeed reads its config with hjson, so configs that DeepSpeed runs may carry trailing commas or
members separated by newlines only; those two are accepted (read by hjson). Everything else that
strict JSON rejects (Python literals, unquoted placeholders such as ``"stage": [0|1|2|3]`` or
``"stage": stage``) is an error naming the line, the column and the fix: hjson would read them as
strings and the run would fail later with a less precise message.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from megazero.errors import ConfigError

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def strip_comments(text: str) -> str:
    """``text`` with ``//`` and ``/* */`` comments replaced by spaces (newlines kept).

    The result has the same length and line structure as ``text``, so JSON error positions map
    back to the user's file unchanged.
    """
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                out[i] = " "
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                line, col = _line_col(text, i)
                raise ConfigError(f"unterminated /* comment starting at line {line}, column {col}; "
                                  f"close it with */")
            for j in range(i, end + 2):
                if out[j] != "\n":
                    out[j] = " "
            i = end + 2
        else:
            i += 1
    return "".join(out)


def _hjson_tolerates(text: str, pos: int, msg: str) -> bool:
    """A trailing comma, or a missing comma where the next member starts on a new line: the
    two relaxations of DeepSpeed's hjson reader that tutorial configs rely on."""
    before = text[:pos].rstrip()
    here = text[pos:pos + 1]
    if before.endswith(",") and here and here in "}]":
        return True
    return "delimiter" in msg and "','" in msg and "\n" in text[len(before):pos]


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _hint(text: str, pos: int, msg: str) -> tuple[int, str]:
    """The position to report and the fix, guessed from what sits at the error position."""
    before = text[:pos].rstrip()
    here = text[pos:pos + 1]
    word = _WORD.match(text, pos)
    if pos >= len(text.rstrip()):
        return len(before), ("the file ends inside a block: close every { and [ (is the end of "
                             "the file missing?)")
    if before.endswith(",") and here in "}]" and here:
        return len(before) - 1, ("trailing comma (not allowed in JSON): remove the trailing "
                                 "comma")
    if here == "|" or (here == "[" and "|" in text[pos:text.find("]", pos) + 1]):
        return pos, ("this looks like a placeholder listing alternatives (e.g. [0|1|2|3]): "
                     "write exactly one value")
    if word:
        w = word.group()
        if w in ("True", "False", "None"):
            return pos, f"{w} is Python, not JSON: write true, false or null"
        if w == "auto":
            return pos, 'write "auto" in double quotes'
        if "property name" in msg:
            return pos, f'keys must be strings in double quotes: write "{w}"'
        return pos, (f"{w!r} is not a JSON value (a variable or placeholder?): write a number, "
                     f"true/false or a string in double quotes")
    if here == "'":
        return pos, "JSON strings use double quotes, not single quotes"
    if here == "#":
        return pos, "# does not start a comment here: use // or /* */"
    if "delimiter" in msg and "','" in msg:
        return pos, "a comma is missing between two entries: add ',' after the previous entry"
    return pos, "fix the JSON syntax here"


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"key {key!r} appears twice in the same block of the DeepSpeed "
                              f"config; keep one of them")
        seen[key] = value
    return seen


def parse_ds_json(text: str, source: str = "DeepSpeed config") -> dict[str, Any]:
    """Parse a DeepSpeed JSON config that may contain comments; raise ConfigError on bad syntax."""
    clean = strip_comments(text)
    try:
        data = json.loads(clean, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as e:
        data = _read_relaxed(clean) if _hjson_tolerates(clean, e.pos, e.msg) else None
        if data is None:
            pos, fix = _hint(clean, e.pos, e.msg)
            line, col = _line_col(clean, pos)
            lines = text.splitlines()
            src_line = lines[line - 1] if 0 < line <= len(lines) else ""
            raise ConfigError(f"{source}: invalid JSON at line {line}, column {col} ({e.msg}): "
                              f"{fix}\n    {src_line}\n    {' ' * (col - 1)}^") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object {{...}}, got "
                          f"{type(data).__name__}")
    return data


def _read_relaxed(clean: str) -> Any:
    """``clean`` read as DeepSpeed reads it (hjson), or None if hjson rejects it too."""
    import hjson

    try:
        data = hjson.loads(clean, object_pairs_hook=_reject_duplicates)
    except hjson.HjsonDecodeError:
        return None
    return json.loads(json.dumps(data))  # hjson's OrderedDicts -> plain dicts


def load_ds_json(path: str | Path) -> dict[str, Any]:
    """Read and parse ``path`` (``--deepspeed_config``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--deepspeed_config {str(path)!r}: cannot read the file ({e.strerror}); "
                          f"give the path of an existing JSON file") from None
    return parse_ds_json(text, source=str(path))
