"""Numbers written by people: one parser for byte sizes (``--shard-size 256MB``,
``cache_size="500GB"``) and one check for int arguments (``batch_size``, ``workers``, ...)."""

from __future__ import annotations

import numbers
import re

from fastload.errors import InvalidArgumentError

__all__ = ["check_int", "format_bytes", "parse_size", "plural"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, allow_zero: bool = False) -> int:
    """Bytes from ``256MB`` (decimal: 256·10⁶), ``1GiB`` / ``1G`` (binary: 2³⁰), or a plain number.

    Accepted units (case-insensitive): B, KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB and
    K, M, G, T (powers of 1024).

    Args:
        value: Bytes as an int, or text such as ``"256MB"``.
        allow_zero: Accept 0 (e.g. a cache budget that caches nothing).

    Raises:
        InvalidArgumentError: Unparseable, negative, or zero without ``allow_zero``.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"size must be a number of bytes or e.g. '256MB', got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidArgumentError(
                f"cannot parse size {value!r}; use bytes or a number with one of the units "
                "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB, K, M, G, T (powers of "
                "1024), e.g. '256MB' or '1GiB'"
            )
        number = int(float(match.group(1)) * _UNITS[unit])
    if number < 0 or (number == 0 and not allow_zero):
        raise InvalidArgumentError(
            f"size must be {'>= 0' if allow_zero else 'positive'}, got {value!r}"
        )
    return number


def check_int(name: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an int if it is one (``numpy`` integers too, ``bool`` not) in
    ``[minimum, maximum]``; else :class:`InvalidArgumentError` naming the argument and the range.

    One check for every int argument, so that each says the same thing the same way.
    """
    if not isinstance(value, bool) and isinstance(value, numbers.Integral):
        number = int(value)
        if number >= minimum and (maximum is None or number <= maximum):
            return number
    wanted = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
    raise InvalidArgumentError(f"{name} must be an int {wanted}, got {value!r}")


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``"34.9 TB"``, ``"111.5 KB"``, ``"12 B"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def plural(count: int, word: str, many: str | None = None) -> str:
    """``plural(1, "shard")`` -> ``1 shard``; ``plural(3, "shard")`` -> ``3 shards``;
    ``plural(2, "class", "classes")`` -> ``2 classes``."""
    return f"{count} {word if count == 1 else (many or word + 's')}"
