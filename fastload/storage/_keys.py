"""Keys, byte ranges and object metadata: the values every store takes and returns.

Keys are ``/``-separated relative paths: non-empty, no leading ``/``, no ``.`` or ``..`` segment,
no empty segment, no NUL byte (:func:`validate_key`). Byte ranges are half-open: ``start``
inclusive, ``end`` exclusive (:class:`ByteRange`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastload.errors import InvalidKeyError, InvalidRangeError

__all__ = [
    "ByteRange",
    "ObjectMeta",
    "check_range",
    "prefix_directory",
    "validate_key",
    "validate_prefix",
]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A half-open byte range of an object.

    Attributes:
        start: First byte, inclusive, ``>= 0``.
        end: One past the last byte, exclusive, ``>= start``. ``ByteRange(0, 0)`` is empty.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.end, int):
            raise InvalidRangeError(f"byte range bounds must be integers, got {self!r}")
        if self.start < 0 or self.end < self.start:
            raise InvalidRangeError(
                f"invalid byte range [{self.start}, {self.end}): need 0 <= start <= end "
                "(start inclusive, end exclusive)"
            )

    @classmethod
    def from_length(cls, start: int, length: int) -> ByteRange:
        """The range of ``length`` bytes beginning at ``start``."""
        return cls(start, start + length)

    @property
    def length(self) -> int:
        """Number of bytes in the range."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What a store knows about one object.

    Attributes:
        key: The object's key, relative to the store root.
        size: Size in bytes.
        mtime: Last modification as seconds since the Unix epoch, or ``None`` if unknown.
        etag: An opaque version tag that changes when the content changes, or ``None``.
    """

    key: str
    size: int
    mtime: float | None = None
    etag: str | None = None


def validate_key(key: str, *, url: str = "") -> str:
    """Check that ``key`` is a valid store key and return it.

    Raises:
        InvalidKeyError: If the key is empty, absolute, has a ``.``/``..``/empty segment or a NUL.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store keys are str, got {type(key).__name__}: {key!r}", url=url)
    if not key:
        raise InvalidKeyError(
            "store key is empty; name an object, e.g. 'data/shard-000000.tar'", url=url
        )
    if "\x00" in key:
        raise InvalidKeyError(f"store key {key!r} contains a NUL byte", url=url)
    if key[0] == "/":
        raise InvalidKeyError(
            f"store key {key!r} is absolute; keys are relative to the store root {url!r}", url=url
        )
    # Fast path (this runs on every read): no empty segment and no segment starting with ".".
    if "//" not in key and key[-1] != "/" and key[0] != "." and "/." not in key:
        return key
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKeyError(
                f"store key {key!r} has an empty, '.' or '..' path segment; keys may not escape "
                f"or alias within the store root {url!r}",
                url=url,
            )
    return key


def validate_prefix(prefix: str, *, url: str = "") -> str:
    """Check a listing prefix: ``""`` or a relative string without NUL (it may end with ``/``)."""
    if not isinstance(prefix, str) or prefix.startswith("/") or "\x00" in prefix:
        raise InvalidKeyError(
            f"listing prefix {prefix!r} must be a relative str without NUL bytes", url=url
        )
    return prefix


def prefix_directory(prefix: str) -> str | None:
    """The ``/``-separated directory holding every key that starts with ``prefix`` (``""``: the
    root), or ``None`` if no valid key can start with it (an empty, ``.`` or ``..`` segment).

    For backends that list by walking directories: walking only this one never leaves the root.
    """
    head = prefix.rpartition("/")[0]
    if head and any(part in ("", ".", "..") for part in head.split("/")):
        return None
    return head


def check_range(byte_range: ByteRange, size: int, *, url: str) -> None:
    """Raise :class:`InvalidRangeError` if ``byte_range`` reaches past an object of ``size`` bytes."""
    if byte_range.end > size:
        raise InvalidRangeError(
            f"byte range [{byte_range.start}, {byte_range.end}) reaches past the end of {url}, "
            f"which is {size} bytes long; request at most [.., {size})",
            url=url,
        )
