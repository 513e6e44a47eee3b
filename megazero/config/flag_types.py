"""One command-line flag as data: :class:`Flag` and the shorthands the flag tables are written
with (:data:`megazero.config.cli.FLAGS` and :data:`megazero.config.script_flags.SCRIPT_FLAGS`).

Kept apart from the parser so several tables can declare flags without importing the parser
(and the parser can import every table)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One command-line option: its spellings, the field it fills and argparse settings."""

    names: tuple[str, ...]
    field: str
    kwargs: dict[str, Any]
    convert: Callable[[Any], Any] | None = None  # command-line value -> field value


def flag(names: str, field: str, convert: Callable[[Any], Any] | None = None, **kw: Any) -> Flag:
    """``flag("--a --b", "section.field", ...)``: a :class:`Flag` spelled as in the tables."""
    return Flag(tuple(names.split()), field, kw, convert)


INT: dict[str, Any] = {"type": int}
FLOAT: dict[str, Any] = {"type": float}
ON: dict[str, Any] = {"action": "store_true"}
