"""A WebDataset index held as NumPy arrays, and the fast parse of the common index shape.

A parsed index lives as long as its process caches it (:mod:`fastload.formats._cache`), so
it is kept compact: per component an offset, a size and a field number (9 bytes: 4-byte offsets
and sizes for shards under 4 GiB, 8 above; 1-byte field numbers for up to 256 fields), per sample
where its components start and its key's bytes (8 bytes plus the key), instead of a list of
:class:`Component` tuples (~250 bytes a sample): ~37 bytes a sample of two fields and an
11-byte key (67 before the narrow types). Member names are not stored: in a ``v1.2`` index
every name is ``<key>.<field>`` (the parse checks it), so they are rebuilt when read.

:func:`parse_uniform` parses, in a few vectorised passes, the shape fastload and ``wds2idx``
write for most datasets: single spaces, and the same fields in the same order on every line. It
applies the same rules as the line-by-line parse in :mod:`~fastload.formats.webdataset.index`,
conservatively: it returns ``None`` for anything else (another shape, a name or number it does
not accept outright), and the line-by-line parse then decides, with its messages.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fastload.errors import CorruptDataError
from fastload.formats.webdataset._tar import BLOCK

__all__ = ["CODEC", "Component", "SampleIndex", "parse_uniform"]

IntArray = npt.NDArray[np.int64]
#: An array of integers of any width (held narrow where the values allow).
Ints = npt.NDArray[np.integer[Any]]
_OTHER_WHITESPACE = b"\t\r\v\f"
#: Offsets, sizes and positions below this are held in 4 bytes (see :class:`SampleIndex`).
_NARROW = 1 << 32


class Component(NamedTuple):
    """One tar member of a sample, as an index line lists it.

    Attributes:
        ext: The field name (the member name after the basename's first dot).
        offset: Byte offset of the member's data in the shard (a multiple of 512).
        size: Data size in bytes.
        name: The full member path; ``""`` when read from a ``v1.1`` index, which has no names.
    """

    ext: str
    offset: int
    size: int
    name: str


class SampleIndex:
    """The components of a shard's samples, in shard order (see module doc).

    ``len(index)`` is the sample count; :meth:`components` gives one sample's members. Immutable
    once built, so one instance may be shared by any number of readers and threads.

    Args:
        starts: ``n + 1`` indices into the component arrays: sample ``i`` has components
            ``starts[i]:starts[i + 1]``.
        offsets: Each component's data offset.
        sizes: Each component's data size.
        fields: Each component's field, as a position in ``exts``.
        exts: The distinct fields.
        keys: The samples' keys, UTF-8 (surrogate escapes) back to back (bytes, or a view of
            a mapped index file), or ``None`` when the index names no members (``v1.1``).
        key_starts: ``n + 1`` offsets of the keys in ``keys`` (``None`` with ``keys``).
    """

    def __init__(
        self,
        starts: Ints,
        offsets: Ints,
        sizes: Ints,
        fields: Ints,
        exts: Sequence[str],
        keys: bytes | memoryview | None,
        key_starts: Ints | None,
    ) -> None:
        self._exts = tuple(exts)
        self._starts = _narrow(starts)
        self._end = int((offsets + sizes).max(initial=0))  # where the last component ends
        wide = self._end >= _NARROW  # the sums must fit the narrow type too
        self._offsets = offsets if wide else _narrow(offsets)
        self._sizes = sizes if wide else _narrow(sizes)
        self._fields: Ints = (
            fields.astype(np.uint8, copy=False) if len(self._exts) <= 256 else fields
        )
        self._keys = keys
        self._key_starts = None if key_starts is None else _narrow(key_starts)

    @classmethod
    def from_samples(cls, samples: Sequence[Sequence[Component]]) -> SampleIndex:
        """The compact form of ``samples`` (every name ``<key>.<ext>``, or every name ``""``).

        Raises:
            CorruptDataError: An offset or size does not fit in 64 bits.
        """
        comps = [c for sample in samples for c in sample]
        numbers: dict[str, int] = {}
        fields = [numbers.setdefault(c.ext, len(numbers)) for c in comps]
        named = bool(comps) and bool(comps[0].name)
        keys = [s[0].name[: len(s[0].name) - len(s[0].ext) - 1] if named else "" for s in samples]
        encoded = [k.encode("utf-8", "surrogateescape") for k in keys]
        try:
            offsets = np.array([c.offset for c in comps], dtype=np.int64)
            sizes = np.array([c.size for c in comps], dtype=np.int64)
        except OverflowError:
            raise CorruptDataError(
                "WebDataset index holds an offset or size beyond 2^63; the index is damaged: "
                "rebuild it with `fastload index`"
            ) from None
        return cls(
            _bounds([len(s) for s in samples]),
            offsets,
            sizes,
            np.array(fields, dtype=np.int32),
            list(numbers),
            b"".join(encoded) if named else None,
            _bounds([len(k) for k in encoded]) if named else None,
        )

    def __len__(self) -> int:
        return len(self._starts) - 1

    @property
    def nbytes(self) -> int:
        """Bytes held (arrays and keys)."""
        arrays = (self._starts, self._offsets, self._sizes, self._fields, self._key_starts)
        return sum(a.nbytes for a in arrays if a is not None) + len(self._keys or b"")

    def key(self, i: int) -> str | None:
        """Sample ``i``'s key, or ``None`` when the index names no members."""
        if self._keys is None or self._key_starts is None:
            return None
        a, b = self._key_starts[i : i + 2].tolist()
        return str(self._keys[a:b], "utf-8", "surrogateescape")

    def components(self, i: int) -> list[Component]:
        """Sample ``i``'s members in shard order (``0 <= i < len(self)``)."""
        a, b = self._starts[i : i + 2].tolist()
        key, exts = self.key(i), self._exts
        return [
            Component(exts[f], o, s, "" if key is None else f"{key}.{exts[f]}")
            for f, o, s in zip(
                self._fields[a:b].tolist(),
                self._offsets[a:b].tolist(),
                self._sizes[a:b].tolist(),
                strict=True,
            )
        ]

    def field_locations(self, ext: str, url: str) -> list[tuple[int, int]]:
        """``(offset, size)`` of field ``ext``'s member in every sample, in shard order.

        Raises:
            KeyError: A sample has no such member (names the first one and its index line).
        """
        n = len(self)
        if ext in self._exts:
            rows = np.flatnonzero(self._fields == self._exts.index(ext))
            owner = np.searchsorted(self._starts, rows, side="right") - 1
            if len(rows) == n and (owner == np.arange(n)).all():
                return list(
                    zip(self._offsets[rows].tolist(), self._sizes[rows].tolist(), strict=True)
                )
            missing = np.setdiff1d(np.arange(n), owner)
            i = int(missing[0]) if len(missing) else int(np.flatnonzero(np.diff(owner) == 0)[0])
        else:
            i = 0
        raise KeyError(f"sample {i} (index line {i + 2}) of {url} has no field {ext!r}")

    def samples(self) -> list[list[Component]]:
        """Every sample's members (a list of lists; large for a large shard)."""
        return [self.components(i) for i in range(len(self))]

    def truncated(self, n: int) -> SampleIndex:
        """The first ``n`` samples."""
        if n >= len(self):
            return self
        c = int(self._starts[n])
        ks = None if self._key_starts is None else self._key_starts[: n + 1]
        keys = None if self._keys is None or ks is None else self._keys[: int(ks[-1])]
        cut = (self._offsets[:c], self._sizes[:c], self._fields[:c])
        return SampleIndex(self._starts[: n + 1], *cut, self._exts, keys, ks)

    def check_bound(self, shard_size: int, url: str) -> None:
        """Raise unless every component lies within a shard of ``shard_size`` bytes.

        Raises:
            CorruptDataError: Names the first index line that points past the end.
        """
        if self._end <= shard_size:
            return
        ends = self._offsets + self._sizes
        past = np.flatnonzero(ends > shard_size)
        j = int(past[0])
        line = int(np.searchsorted(self._starts, j, side="right")) - 1 + 2
        raise CorruptDataError(
            f"WebDataset index line {line} points at bytes [{self._offsets[j]}, {ends[j]}) but "
            f"the shard is {shard_size} bytes long; the index belongs to another version of the "
            "shard; the index is damaged or stale: rebuild it with `fastload index`",
            url=url,
        )


def _narrow(values: Ints) -> Ints:
    """``values`` (non-negative) as 4-byte unsigned integers where they all fit, else as given."""
    if len(values) and int(values.max()) < _NARROW and int(values.min()) >= 0:
        return values.astype(np.uint32, copy=False)
    return values


def _bounds(lengths: Sequence[int]) -> IntArray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


def parse_uniform(data: bytes, rows: list[bytes]) -> SampleIndex | None:
    """The index of ``rows`` (a ``v1.2`` index's sample lines, without the header line or
    newlines; ``data`` is the whole file) when they have the common shape and pass every check of
    the line-by-line parse; ``None`` otherwise (see module doc)."""
    n = len(rows)
    if not n or len(data.translate(None, _OTHER_WHITESPACE)) != len(data):
        return None
    m = rows[0].count(b" ") + 1
    if m % 4 or set(map(operator.methodcaller("count", b" "), rows)) != {m - 1}:
        return None
    tokens = b" ".join(rows).split(b" ")
    if b"" in tokens:  # two spaces in a row, or a line that starts or ends with one
        return None
    k = m // 4
    exts = [tokens[4 * c] for c in range(k)]
    if len(set(exts)) != k or any(tokens[4 * c :: m].count(exts[c]) != n for c in range(k)):
        return None  # samples with other fields, or a field twice
    for ext in exts:
        text = ext.decode("utf-8", "surrogateescape")
        if b"/" in ext or b"\\" in ext or text.startswith("__"):
            return None
    suffix = b"." + exts[0]
    keys = [name[: -len(suffix)] for name in tokens[3::m]]
    if any([key + b"." + exts[c] for key in keys] != tokens[4 * c + 3 :: m] for c in range(k)):
        return None  # a name that is not <key>.<field>
    joined = b"\n" + b"\n".join(keys)
    last = [key.rpartition(b"/")[2] for key in keys]
    if not all(last) or b"." in b"/".join(last) or b"\n/" in joined:
        return None  # no key, a dot in the key's basename, an absolute path
    if b".." in joined or b"\\" in joined or any(map(operator.eq, keys, keys[1:])):
        return None  # a possible '..' segment or backslash path; two lines with one key
    try:
        offsets = np.array([list(map(int, tokens[4 * c + 1 :: m])) for c in range(k)], np.int64)
        sizes = np.array([list(map(int, tokens[4 * c + 2 :: m])) for c in range(k)], np.int64)
    except (ValueError, OverflowError):
        return None
    offsets, sizes = offsets.T.ravel(), sizes.T.ravel()  # component order: sample by sample
    ends = offsets + sizes + (-sizes % BLOCK)
    if (
        (offsets < BLOCK).any()
        or (offsets % BLOCK).any()
        or (sizes < 0).any()
        or (offsets[1:] - BLOCK < ends[:-1]).any()
    ):
        return None
    return SampleIndex(
        np.arange(0, n * k + 1, k, dtype=np.int64),
        offsets,
        sizes,
        np.tile(np.arange(k, dtype=np.int32), n),
        [ext.decode("utf-8", "surrogateescape") for ext in exts],
        b"".join(keys),
        _bounds(list(map(len, keys))),
    )


class Codec:
    """A :class:`SampleIndex` as arrays and back, for the index files every process maps
    (:mod:`fastload.formats._cache._files`)."""

    @staticmethod
    def to_arrays(value: SampleIndex) -> tuple[dict[str, Ints], dict[str, Any]]:
        arrays = {
            "starts": value._starts,
            "offsets": value._offsets,
            "sizes": value._sizes,
            "fields": value._fields,
        }
        if value._keys is not None and value._key_starts is not None:
            arrays["keys"] = np.frombuffer(value._keys, dtype=np.uint8)
            arrays["key_starts"] = value._key_starts
        return arrays, {"exts": list(value._exts)}

    @staticmethod
    def from_arrays(arrays: dict[str, Ints], values: dict[str, Any]) -> SampleIndex:
        keys = arrays.get("keys")
        return SampleIndex(
            arrays["starts"],
            arrays["offsets"],
            arrays["sizes"],
            arrays["fields"],
            [str(ext) for ext in values["exts"]],
            None if keys is None else keys.data,
            arrays.get("key_starts"),
        )


#: The codec of WebDataset's parsed indexes.
CODEC = Codec()
