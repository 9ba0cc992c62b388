"""What the subcommands share: exit statuses, output, option types, the subparser set-up."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fastload.errors import FastloadError

__all__ = [
    "EXIT_CODES_HELP",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SKIPPED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "UsageError",
    "add_command",
    "block_size",
    "count",
    "out",
    "positive_int",
    "registered",
    "shard_progress",
    "size",
    "table",
    "whole_number",
]

#: Exit status: success.
EXIT_OK = 0
#: Exit status: an error stopped the command (message on stderr), or ``verify`` found problems.
EXIT_ERROR = 1
#: Exit status: invalid command line.
EXIT_USAGE = 2
#: Exit status: conversion completed, but items were left out: skipped under ``--on-error skip``,
#: or loops, links not followed and duplicates of the source tree (see the skip report).
EXIT_SKIPPED = 3
#: Exit status: ``verify`` could not read the store (retries ran out): no verdict on the data.
EXIT_UNAVAILABLE = 4
#: Exit status: interrupted (Ctrl-C); a re-run of ``convert`` resumes.
EXIT_INTERRUPTED = 130

#: The exit statuses as every ``--help`` lists them.
EXIT_CODES_HELP = """exit status:
  0    success
  1    error (message on stderr), or verify found problems
  2    invalid command line
  3    convert completed, but items were left out (skipped under --on-error skip, or
       loops, links not followed and duplicates in the tree; see _fastload_skipped.jsonl)
  4    verify could not read the store (network or server; retries ran out): no verdict
  130  interrupted; re-run the same convert command to resume
"""


class UsageError(Exception):
    """A command line that parses but makes no sense (exit status 2)."""


def out(text: str = "") -> None:
    """Print a line of the command's output on stdout."""
    sys.stdout.write(text + "\n")


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """``rows`` under ``header`` in aligned columns (numbers right-aligned), with a rule."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w) for c, w in zip(r, widths))

    lines = [line(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in cells[1:]]
    return "\n".join(x.rstrip() for x in lines)


def add_command(
    sub: Any,
    name: str,
    run: Callable[[argparse.Namespace], int],
    *,
    help: str,  # noqa: A002 - argparse's name
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Add subcommand ``name``, run by ``run(args) -> exit status``; its ``--help`` ends with the
    exit statuses."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=description,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=run)
    return p


# ---- option values ------------------------------------------------------------------------------
# Bad values are usage errors (exit 2, with the usage line), found before anything runs.


def whole_number(minimum: int, wanted: str | None = None) -> Callable[[str], int]:
    """argparse type: a whole number of at least ``minimum``. A smaller one is refused with
    ``expected WANTED, got N`` when ``wanted`` is given, else ``must be at least MINIMUM, got N``."""
    too_small = f"expected {wanted}" if wanted is not None else f"must be at least {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{too_small}, got {value}")
        return value

    return parse


#: argparse type: an int >= 1.
positive_int = whole_number(1)
#: argparse type: an int >= 0.
count = whole_number(0)


def block_size(text: str) -> int | None:
    """argparse type: a shuffle block in samples (an int >= 1), or ``none`` for whole shards
    (the streaming shuffle)."""
    if text.strip().lower() == "none":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'none')") from None


def size(text: str) -> int:
    """argparse type: a size in bytes, ``256MB`` or ``1GiB`` (see :func:`fastload._units.parse_size`)."""
    from fastload._units import parse_size

    try:
        return parse_size(text)
    except FastloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def registered(registry: str) -> Callable[[str], str]:
    """argparse type for a name of a plugin registry (formats, sources), with did-you-mean."""

    def parse(text: str) -> str:
        from fastload.convert.sources import SOURCES
        from fastload.formats import FORMATS

        reg = FORMATS if registry == "format" else SOURCES
        try:
            return str(reg.canonical(text))
        except FastloadError as exc:
            message = str(exc).split(". Pass one of these", 1)[0]
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = registry  # argparse names the type in its messages
    return parse


def shard_progress(command: str) -> Callable[[int, int, int], None] | None:
    """A progress bar on stderr for ``verify``/``index`` (shards and bytes), on a terminal only."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(desc=f"fastload {command}", unit="shard", file=sys.stderr, leave=False)

    def update(done: int, total: int, nbytes: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update
