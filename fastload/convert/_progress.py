"""What a conversion prints while it runs: progress (a tqdm bar on a terminal, plain lines
otherwise), the source's warnings, and the number formats they use."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from fastload._units import format_bytes, plural

__all__ = ["Progress", "WarningPrinter", "format_bytes", "format_duration", "plural"]

# format_bytes and plural live in fastload._units (shared with the CLI and the capacity model).


def format_duration(seconds: float) -> str:
    """``83.2`` → ``1:23``; ``4000`` → ``1:06:40``."""
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Samples and bytes converted so far, shown as a tqdm bar (terminal) or as a plain line every
    ``interval`` seconds (pipes, logs). Silent with ``quiet=True``. Used from one thread.

    Args:
        total_samples: Samples planned (for the percentage and ETA).
        total_bytes: Bytes estimated (for MB/s context only).
        quiet: Show nothing.
        stream: Where to write (default ``sys.stderr``).
        interval: Seconds between plain lines.
    """

    def __init__(
        self,
        total_samples: int,
        total_bytes: int,
        *,
        quiet: bool = False,
        stream: IO[str] | None = None,
        interval: float = 10.0,
    ) -> None:
        self.total_samples, self.total_bytes = total_samples, total_bytes
        #: Whether the totals are final (see :meth:`planned`).
        self.complete = True
        self.quiet, self.interval = quiet, interval
        self.stream = stream if stream is not None else sys.stderr
        self.samples = 0
        self.bytes = 0
        self.start = time.monotonic()
        self._last_line = self.start
        self._bar: Any = None
        if not quiet and _isatty(self.stream):
            from tqdm import tqdm

            class _Bar(tqdm):  # type: ignore[type-arg]
                # No monitor thread: conversion forks its workers only while it runs one thread.
                monitor_interval = 0

            self._bar = _Bar(
                total=total_samples,
                unit="sample",
                unit_scale=True,
                file=self.stream,
                desc="converting",
                dynamic_ncols=True,
            )

    def planned(self, samples: int, nbytes: int, *, complete: bool) -> None:
        """Set the totals planned so far; ``complete``: the plan is whole (until then the
        percentage and ETA are unknown: the bar shows the samples planned so far as its total,
        ``(planning)`` instead of a percentage, and no ETA, as the plain line does)."""
        changed = (samples, complete) != (self.total_samples, self.complete)
        self.total_samples, self.total_bytes, self.complete = samples, nbytes, complete
        if self._bar is not None and changed:
            if complete:
                self._bar.bar_format = None  # tqdm's own: percentage, bar, ETA
                self._bar.total = samples
            else:
                self._bar.total = None  # no percentage, no ETA
                self._bar.bar_format = (
                    f"{{desc}}: {{n_fmt}}/{samples} samples (planning) "
                    "[{elapsed}, {rate_fmt}{postfix}]"
                )
            self._bar.refresh()

    def update(self, samples: int, nbytes: int) -> None:
        """Set the absolute totals converted so far (monotonic)."""
        samples, nbytes = max(samples, self.samples), max(nbytes, self.bytes)
        delta = samples - self.samples
        self.samples, self.bytes = samples, nbytes
        if self.quiet:
            return
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        if self._bar is not None:
            if delta:
                self._bar.update(delta)
            self._bar.set_postfix_str(f"{nbytes / elapsed / 1e6:.1f} MB/s", refresh=False)
        elif now - self._last_line >= self.interval:
            self._last_line = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        """A one-line status: counts, rates, ETA."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.samples / elapsed
        pct = 100.0 * self.samples / self.total_samples if self.total_samples else 100.0
        eta = (self.total_samples - self.samples) / rate if rate > 0 else float("nan")
        eta_text = format_duration(eta) if eta == eta and self.complete else "?"
        done = f"{pct:.1f}%" if self.complete else "planning"
        return (
            f"fastload convert: {self.samples}/{self.total_samples} samples ({done}), "
            f"{rate:.0f} samples/s, {self.bytes / elapsed / 1e6:.1f} MB/s, ETA {eta_text}"
        )

    def close(self) -> None:
        """Finish the bar (or nothing for plain lines)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def message(self, text: str) -> None:
        """Print a line (unless quiet), without breaking the bar."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()


class WarningPrinter:
    """Prints the warnings of a list that were not printed yet (nothing when ``quiet``), as
    ``fastload convert: warning: ...`` lines. ``convert`` calls it after opening the source and
    again after planning, which may add to the source's list."""

    def __init__(self, warnings: list[str], stream: IO[str], quiet: bool) -> None:
        self.warnings, self.stream, self.quiet = warnings, stream, quiet
        self.said: list[str] = []

    def __call__(self) -> None:
        for text in self.warnings:
            if text not in self.said:
                self.said.append(text)
                if not self.quiet:
                    self.stream.write(f"fastload convert: warning: {text}\n")
                    self.stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
