"""Parsing a command line into the flags it typed, naming every problem of it at once.

An unknown flag names its equivalent (:mod:`megazero.config.flag_aliases`) or the closest
spelling; a value its flag refuses is noted and the rest parsed on; the flags of a feature
megazero does not have yet (FP4) share one message. :func:`raise_problems` turns the list into
one :class:`~megazero.errors.ConfigError`, so one launch tells the user everything to fix.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megazero.config.cli import FLAGS, build_parser
from megazero.config.flag_aliases import not_yet_problem, not_yet_reason, rewrite_aliases, suggest
from megazero.errors import ConfigError


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Only the flags given in ``argv``; every problem (an unknown flag, a bad value) is raised
    together in one error (:func:`parse_args_collecting`). ``-h``/``--help`` prints the help
    and exits 0, as argparse does."""
    args, problems = parse_args_collecting(argv)
    raise_problems(problems)
    return args


def parse_args_collecting(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags given in ``argv`` that parse, and one message per problem of the others: an
    unknown flag (naming the equivalent flag, :mod:`megazero.config.flag_aliases`, or the
    closest spelling), a value its flag refuses (an invalid choice, not a number), a flag of a
    feature megazero does not have yet. A flag with a bad value is left out and the rest is
    parsed again, so one launch names every problem of its command line."""
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv[:argv.index("--") if "--" in argv else None]):
        build_parser().print_help()
        raise SystemExit(0)
    argv, problems = rewrite_aliases(argv)
    parser = build_parser(explicit_only=True)
    for _ in range(len(argv) + 1):
        try:
            args, unknown = parser.parse_known_args(argv)
            break
        except argparse.ArgumentError as e:
            problems.append(str(e))
            argv = _without(argv, (e.argument_name or "").split("/"))
    else:  # pragma: no cover (each round removes a flag)
        raise ConfigError("command line: could not be parsed")
    problems.extend(_unknown_problems(unknown))
    return args, problems


def raise_problems(problems: Sequence[str], where: str | None = "command line") -> None:
    """One :class:`ConfigError` naming every problem, or nothing when there is none.
    ``where`` prefixes the message (None: the problems name their flags and keys)."""
    prefix = f"{where}: " if where else ""
    if len(problems) == 1:
        raise ConfigError(f"{prefix}{problems[0]}")
    if problems:
        listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        unknown_only = all(p.startswith(("unknown argument", "unexpected value"))
                           or " is not a megazero flag" in p for p in problems)
        what = "arguments are not megazero's" if unknown_only else "problems"
        raise ConfigError(f"{prefix}{len(problems)} {what}, all listed here: {listed}")


def _without(argv: list[str], names: Sequence[str]) -> list[str]:
    """``argv`` without the flags ``names`` and the values that follow them."""
    out: list[str] = []
    dropping = False
    for token in argv:
        if token.startswith("-") and not _is_number(token):
            dropping = token.partition("=")[0] in names
            if not dropping:
                out.append(token)
        elif not dropping:
            out.append(token)
    return out


def _unknown_problems(unknown: Sequence[str]) -> list[str]:
    """One message per unknown flag; the values that follow an unknown flag belong to it. The
    flags of a feature megazero does not have yet (FP4) share one message."""
    known = [n for flag in FLAGS for n in flag.names]
    problems: list[str] = []
    not_yet: list[str] = []  # "--fp4-format nvfp4", ...
    last: list[str] | None = None  # where the flag the next value belongs to went
    for token in unknown:
        if token.startswith("-") and not _is_number(token):
            if not_yet_reason(token.split("=")[0]) is not None:
                not_yet.append(token)
                last = not_yet
            else:
                problems.append(suggest(token.split("=")[0], known, token))
                last = problems
        elif last is not_yet:
            not_yet[-1] += f" {token}"
        elif last is None:
            problems.append(suggest(token, known, token))
    if not_yet:
        problems.insert(0, not_yet_problem(not_yet))
    return problems


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False
