"""POSIX tar headers at the byte level: encoding for the writer, field parsing for the scanner.

Nothing here knows about samples; :mod:`._scan` walks an archive's members with these functions,
and :mod:`.reader`, :mod:`.writer` and :mod:`.index` build on both. See this package's
``README.md`` for the layout these functions read and write.
"""

from __future__ import annotations

import zlib

from fastload.errors import InvalidArgumentError

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "MAX_USTAR_SIZE",
    "ZERO_BLOCK",
    "checksum_ok",
    "encode_member_header",
    "parse_octal",
    "parse_pax",
    "split_member_name",
    "unsafe_name_reason",
    "ustar_name",
]

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
#: Two zero blocks end an archive.
END_OF_ARCHIVE = bytes(2 * BLOCK)
#: Largest size the 11-digit octal ustar size field holds (8 GiB - 1); larger needs a pax record.
MAX_USTAR_SIZE = 0o77777777777

_NAME_MAX, _PREFIX_MAX = 100, 155
_PAX_NAME = b"././@PaxHeader"


# ---- header encoding (writer side) ----------------------------------------------------------


def _octal(value: int, width: int) -> bytes:
    """``width - 1`` zero-padded octal digits and a NUL, as ustar numeric fields are written."""
    return b"%0*o\x00" % (width - 1, value)


def _header(name: bytes, prefix: bytes, size: int, typeflag: bytes) -> bytes:
    """One ustar header block with fastload's fixed metadata (mode 0644, uid/gid 0, mtime 0)."""
    parts = [
        name.ljust(_NAME_MAX, b"\0"),
        b"0000644\x00",  # mode
        b"0000000\x00",  # uid
        b"0000000\x00",  # gid
        _octal(size, 12),
        _octal(0, 12),  # mtime
        b"        ",  # checksum placeholder: 8 spaces
        typeflag,
        bytes(100),  # linkname
        b"ustar\x0000",  # magic + version
        bytes(32),  # uname
        bytes(32),  # gname
        b"0000000\x00",  # devmajor
        b"0000000\x00",  # devminor
        prefix.ljust(_PREFIX_MAX, b"\0"),
        bytes(12),
    ]
    block = bytearray(b"".join(parts))
    block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def ustar_name(name: bytes) -> tuple[bytes, bytes] | None:
    """Split an encoded member path into ustar ``(prefix, name)``, or ``None`` if it cannot fit.

    Paths of at most 100 bytes go into ``name`` alone. Longer paths are split at a ``/`` so that
    the part before it fits the 155-byte prefix and the part after it the 100-byte name; the
    shortest such prefix is chosen, so the split is deterministic.
    """
    if len(name) <= _NAME_MAX:
        return b"", name
    first = max(0, len(name) - _NAME_MAX - 1)
    for i in range(first, min(len(name), _PREFIX_MAX + 1)):
        if name[i] == 0x2F and i > 0 and i < len(name) - 1:  # b"/"
            return name[:i], name[i + 1 :]
    return None


def _pax_records(records: dict[str, bytes]) -> bytes:
    out = bytearray()
    for key, value in records.items():
        body = b" " + key.encode("ascii") + b"=" + value + b"\n"
        length = len(body) + 1
        while len(str(length)) + len(body) != length:
            length = len(str(length)) + len(body)
        out += str(length).encode("ascii") + body
    return bytes(out)


def encode_member_header(name: bytes, size: int) -> bytes:
    """The header block(s) of a regular file member ``name`` of ``size`` bytes.

    Uses a single ustar header when the path fits ustar's name + prefix fields and the size fits
    its 11 octal digits; otherwise a pax extended header (``x``) carrying ``path`` and/or ``size``
    precedes it. The result is a multiple of 512 bytes; the member's data follows it.
    """
    if size < 0:
        raise InvalidArgumentError(f"member size must be >= 0, got {size}")
    records: dict[str, bytes] = {}
    split = ustar_name(name)
    if split is None:
        records["path"] = name
        split = (b"", name[:_NAME_MAX])
    if size > MAX_USTAR_SIZE:
        records["size"] = str(size).encode("ascii")
    main = _header(split[1], split[0], 0 if "size" in records else size, b"0")
    if not records:
        return main
    pax = _pax_records(records)
    pad = -len(pax) % BLOCK
    return _header(_PAX_NAME, b"", len(pax), b"x") + pax + bytes(pad) + main


# ---- header decoding (reader side) ----------------------------------------------------------


def parse_octal(field: bytes) -> int:
    """A ustar numeric field: octal digits (NUL/space padded) or GNU base-256 (high bit set).

    Raises:
        ValueError: The field is neither.
    """
    if field and field[0] & 0x80:
        value = int.from_bytes(field, "big") & ~(0x80 << (8 * (len(field) - 1)))
        if field[0] & 0x40:  # negative in two's complement: never valid for sizes
            raise ValueError(f"negative base-256 number {field!r}")
        return value
    digits = field.split(b"\0", 1)[0].strip()
    return int(digits, 8) if digits else 0


def checksum_ok(hdr: bytes) -> bool:
    """Whether a 512-byte header's checksum field matches its bytes.

    The checksum is the sum of the header's bytes with the checksum field counted as 8 spaces;
    POSIX sums them unsigned, some historic writers signed; both are accepted.
    """
    try:
        stored = parse_octal(hdr[148:156])
    except ValueError:
        return False
    field = hdr[148:156]
    field_sum = sum(field)
    # adler32's low half is 1 + (sum of bytes) mod 65521. The unsigned header sum lies in
    # [256, 512 * 255] < 2 * 65521, so it is one of two values, and a stored checksum that
    # differs from the real sum by exactly 65521 cannot come from changing one octal digit.
    low = ((zlib.adler32(hdr) & 0xFFFF) - 1 - field_sum + 256) % 65521
    if stored == low or stored == low + 65521:
        return True
    unsigned = sum(hdr) - field_sum + 256
    high = sum(1 for b in hdr if b >= 128) - sum(1 for b in field if b >= 128)
    return stored == unsigned - 256 * high


def split_member_name(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member path, split at the first ``.`` after the last ``/``.

    Returns ``None`` for members that are not sample components: no ``.`` in the last path
    segment, or an empty basename (hidden files such as ``.foo`` or ``dir/.foo``).
    """
    dot = name.find(".", name.rfind("/") + 1)
    if dot <= 0 or name[dot - 1] == "/":
        return None
    return name[:dot], name[dot + 1 :]


def unsafe_name_reason(name: str) -> str | None:
    """Why a member path is unsafe to use as a relative path, or ``None`` if it is safe."""
    if name.startswith("/"):
        return "is an absolute path"
    if ".." in name.split("/"):
        return "escapes its directory with a '..' segment"
    if "\\" in name and ".." in name.replace("\\", "/").split("/"):
        return "escapes its directory with a '..' segment (backslash-separated)"
    return None


def parse_pax(data: bytes) -> dict[bytes, bytes]:
    """Records of a pax extended header body: ``"<len> <key>=<value>\\n"`` repeated."""
    out: dict[bytes, bytes] = {}
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] == 0:  # NUL padding after the last record
            break
        space = data.find(b" ", pos, min(end, pos + 24))
        if space < 0:
            raise ValueError(f"pax record at byte {pos} has no length field")
        length = int(data[pos:space])
        record = data[space + 1 : pos + length]
        if length <= 0 or pos + length > end or not record.endswith(b"\n") or b"=" not in record:
            raise ValueError(f"pax record at byte {pos} is malformed")
        key, value = record[:-1].split(b"=", 1)
        out[key] = value
        pos += length
    return out
