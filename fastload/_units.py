"""Byte sizes written by people (``--shard-size 256MB``, ``cache_size="500GB"``): one parser."""

from __future__ import annotations

import re

from fastload.errors import InvalidArgumentError

__all__ = ["parse_size"]

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
