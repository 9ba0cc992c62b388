"""The ``fastload`` command: ``convert``, ``inspect``, ``verify``, ``index``, ``plan-capacity``.

Each subcommand is a thin layer over the Python API in :mod:`fastload.convert`: ``convert`` in
:mod:`._convert`, ``inspect``, ``verify`` and ``index`` in :mod:`._tools`, ``plan-capacity`` (the
capacity model of :mod:`fastload._capacity`) in :mod:`._capacity`. Adding one means
writing a function that adds its parser (with :func:`._common.add_command`) and listing it in
:data:`SUBCOMMANDS`. The exit statuses are the constants of :mod:`._common` (``EXIT_OK``, ...),
re-exported here.

Subcommands that open a store take the store options of :mod:`._store_options`
(``--endpoint-url``, ``--store-option KEY=VALUE``; ``convert`` also ``--src-store-option``), and
the retry lines of :class:`fastload.storage.RetryStore` (INFO on the ``fastload.storage`` logger)
are printed on stderr, one per retry.

Exit status (every subcommand):
  0  success
  1  error (message on stderr), or ``verify`` found problems
  2  invalid command line
  3  ``convert`` completed, but items were left out (skipped under ``--on-error skip``, or loops,
     links not followed and duplicates in the tree; see ``_fastload_skipped.jsonl``)
  4  ``verify`` could not read the store (network or server, after the retries): no verdict
  130 interrupted (Ctrl-C); a re-run of ``convert`` resumes
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from fastload._os import interrupts_ignored
from fastload._version import __version__
from fastload.cli import _capacity, _convert, _report, _tools
from fastload.cli._common import (
    EXIT_CODES_HELP,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SKIPPED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    UsageError,
)
from fastload.cli._convert import convert_exit_status
from fastload.cli._store_options import parse_option_value, show_retries
from fastload.errors import FastloadError

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SKIPPED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "SUBCOMMANDS",
    "build_parser",
    "convert_exit_status",
    "main",
    "parse_option_value",
]

#: Subcommand name → function adding its parser (which sets ``func``).
SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "convert": _convert.add,
    "inspect": _tools.add_inspect,
    "verify": _tools.add_verify,
    "index": _tools.add_index,
    "plan-capacity": _capacity.add,
    "report": _report.add,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``fastload`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="fastload",
        description="fastload: convert corpora to shards, inspect, verify and index datasets.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fastload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastload`` command; returns the exit status (see the module docstring)."""
    return _main(argv, exiting=False)


def run() -> NoReturn:
    """The ``fastload`` program (its console script and ``python -m fastload.cli``):
    :func:`main`, then exit with its status. Once a command is interrupted, further Ctrl-C are
    ignored until the process has exited: one that came while the interpreter shuts down would
    end it by SIGINT instead of exit status 130."""
    sys.exit(_main(None, exiting=True))


def _main(argv: Sequence[str] | None, exiting: bool) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    show_retries(args.command, quiet=bool(getattr(args, "quiet", False)))
    try:
        code: int = args.func(args)
    except UsageError as exc:
        sys.stderr.write(f"fastload {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        # convert has said how far it got and how to resume (its note; printed already unless
        # --quiet); the other commands have nothing to resume. Ctrl-C again meanwhile: the
        # command is ending already.
        with interrupts_ignored(keep=exiting):
            notes = getattr(exc, "__notes__", None)
            if not notes:
                sys.stderr.write(f"fastload {args.command}: interrupted\n")
            elif getattr(args, "quiet", False):
                for note in notes:
                    sys.stderr.write(f"fastload {args.command}: {note}\n")
            sys.stderr.flush()
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `fastload inspect ... | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing at exit does not fail again
        return EXIT_OK
    except (FastloadError, OSError) as exc:
        sys.stderr.write(f"fastload {args.command}: error: {exc}\n")
        for note in getattr(exc, "__notes__", ()):
            sys.stderr.write(f"  {note}\n")
        return EXIT_ERROR
    return code
