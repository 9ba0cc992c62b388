"""TFRecord framing: ``uint64le length | masked crc32c(length) | payload | masked crc32c(payload)``.

CRC32C comes from ``google_crc32c`` (a C extension using the CPU's CRC32 instructions); it only
accepts ``bytes``, so callers hand it ``bytes`` objects, never memoryviews.
"""

from __future__ import annotations

import struct
import warnings

from fastload.errors import MissingDependencyError

__all__ = [
    "FOOTER_SIZE",
    "HEADER",
    "HEADER_SIZE",
    "U32LE",
    "crc32c",
    "crc32c_extend",
    "frame_footer",
    "frame_header",
    "mask",
    "masked_crc",
    "unmask_crc",
    "valid_header",
]

try:
    with warnings.catch_warnings():
        # google_crc32c warns and falls back to pure Python when its C extension is missing; we
        # refuse that fallback below instead (it is ~1000x slower), so the warning is noise.
        warnings.simplefilter("ignore", RuntimeWarning)
        import google_crc32c
except ImportError as exc:  # pragma: no cover - google-crc32c is a core dependency
    raise MissingDependencyError(
        "the TFRecord format needs google-crc32c: pip install google-crc32c"
    ) from exc

if google_crc32c.implementation != "c":  # pragma: no cover - depends on the installed wheel
    raise MissingDependencyError(
        "google-crc32c is installed without its C extension, so CRC32C would run in pure Python "
        "(~1000x slower); reinstall a binary wheel: pip install --force-reinstall google-crc32c"
    )

#: Bytes before the payload: the length and its masked CRC.
HEADER_SIZE = 12
#: Bytes after the payload: its masked CRC.
FOOTER_SIZE = 4

_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
#: ``(length, masked length CRC)`` at the start of a record.
HEADER = struct.Struct("<QI")
#: A masked CRC.
U32LE = struct.Struct("<I")

crc32c = google_crc32c.value
crc32c_extend = google_crc32c.extend


def masked_crc(data: bytes) -> int:
    """The masked CRC32C TFRecord stores for ``data``: ``rotr15(crc) + 0xa282ead8 mod 2**32``."""
    crc: int = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def mask(crc: int) -> int:
    """Mask a raw CRC32C value the way TFRecord does."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def unmask_crc(masked: int) -> int:
    """Invert :func:`mask`: the raw CRC32C a masked value stands for."""
    rot = (masked - _MASK_DELTA) & _U32
    return ((rot >> 17) | (rot << 15)) & _U32


def frame_header(length: int) -> bytes:
    """The 12 bytes that precede a payload of ``length`` bytes."""
    raw = length.to_bytes(8, "little")
    return raw + U32LE.pack(masked_crc(raw))


def frame_footer(crc: int) -> bytes:
    """The 4 bytes that follow a payload whose raw CRC32C is ``crc``."""
    return U32LE.pack(mask(crc))


def valid_header(header: bytes) -> bool:
    """True if ``header`` (at least 12 bytes) starts with a length whose masked CRC matches."""
    if len(header) < HEADER_SIZE:
        return False
    stored: int = U32LE.unpack_from(header, 8)[0]
    return masked_crc(header[:8]) == stored
