"""``fastload report LOG_DIR``: a run's stats logs drawn as one PNG (:mod:`fastload.report`)."""

from __future__ import annotations

import argparse
from typing import Any

from fastload.cli._common import EXIT_OK, add_command, out

__all__ = ["add"]


def add(sub: Any) -> None:
    """Add the ``report`` subcommand to ``sub``."""
    p = add_command(
        sub,
        "report",
        _run,
        help="draw the stats logs of a run (fastload.loader.log_stats) as a PNG",
    )
    p.add_argument("log_dir", help="directory of the rank-*.jsonl stats logs")
    p.add_argument(
        "-o", "--output", default="fastload-report.png", help="PNG to write (fastload-report.png)"
    )


def _run(args: argparse.Namespace) -> int:
    from fastload.report import draw_report

    panels = draw_report(args.log_dir, args.output)
    out(f"wrote {args.output}: {', '.join(panels)}")
    return EXIT_OK
