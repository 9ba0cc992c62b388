"""DALI-compatible WebDataset index files (the format DALI's ``wds2idx`` tool writes).

Text, ``\\n``-terminated lines::

    v1.2 <num_samples>
    <ext> <data_offset> <size> <member_name>[ <ext> <data_offset> <size> <member_name>]...

one line per sample, components in tar order. See this package's ``README.md`` for every rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from fastload.errors import FormatError
from fastload.formats.webdataset._source import open_shard
from fastload.formats.webdataset._tar import (
    BLOCK,
    DIRECTORY,
    REGULAR,
    Bad,
    ShardView,
    scan,
    split_member_name,
    unsafe_name_reason,
)
from fastload.storage import Store

__all__ = ["Component", "build_index", "format_index", "has_index_whitespace", "parse_index"]

INDEX_VERSION = "v1.2"
_ASCII_WHITESPACE = frozenset(" \t\n\v\f\r")


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


def has_index_whitespace(text: str) -> bool:
    """Whether ``text`` has a character that DALI's index reader treats as a separator."""
    return not _ASCII_WHITESPACE.isdisjoint(text)


def format_index(samples: Iterable[Sequence[Component]]) -> bytes:
    """Serialise samples' components as a ``v1.2`` index, byte for byte as ``wds2idx`` does."""
    lines = [" ".join(f"{c.ext} {c.offset} {c.size} {c.name}" for c in comps) for comps in samples]
    text = f"{INDEX_VERSION} {len(lines)}\n" + "".join(line + "\n" for line in lines)
    return text.encode("utf-8", "surrogateescape")


def parse_index(
    data: bytes, *, url: str = "", shard_size: int | None = None
) -> list[list[Component]]:
    """Parse a ``v1.2`` (or ``v1.1``) WebDataset index.

    Args:
        data: The index file's bytes.
        url: The index URL, for messages.
        shard_size: If given, every component must lie within a shard of this many bytes.

    Raises:
        FormatError: The index is malformed, has another version, or its sample count line
            disagrees with its lines; the message says to rebuild it with ``fastload index``.
    """
    fix = "; rebuild it with `fastload index`"
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise FormatError(f"WebDataset index is empty{fix}", url=url)
    head = lines[0].split()
    if len(head) != 2 or head[0] not in (b"v1.1", b"v1.2") or not head[1].isdigit():
        raise FormatError(
            f"WebDataset index header {lines[0][:40]!r} is not 'v1.2 <num_samples>' "
            f"(or 'v1.1 <num_samples>'){fix}",
            url=url,
        )
    per = 4 if head[0] == b"v1.2" else 3
    count = int(head[1])
    if count != len(lines) - 1:
        raise FormatError(
            f"WebDataset index declares {count} samples but has {len(lines) - 1} sample lines{fix}",
            url=url,
        )
    out: list[list[Component]] = []
    for lineno, line in enumerate(lines[1:], start=2):
        tokens = line.split()
        if not tokens or len(tokens) % per:
            raise FormatError(
                f"WebDataset index line {lineno} has {len(tokens)} fields, expected a multiple of "
                f"{per} (<ext> <offset> <size>{' <name>' if per == 4 else ''}){fix}",
                url=url,
            )
        comps = []
        for j in range(0, len(tokens), per):
            try:
                offset, size = int(tokens[j + 1]), int(tokens[j + 2])
            except ValueError:
                offset = size = -1
            if offset < BLOCK or size < 0 or offset % BLOCK:
                raise FormatError(
                    f"WebDataset index line {lineno}: component {j // per} has offset "
                    f"{tokens[j + 1]!r} and size {tokens[j + 2]!r}; offsets are positive multiples "
                    f"of 512 and sizes non-negative{fix}",
                    url=url,
                )
            if shard_size is not None and offset + size > shard_size:
                raise FormatError(
                    f"WebDataset index line {lineno} points at bytes [{offset}, {offset + size}) "
                    f"but the shard is {shard_size} bytes long; the index belongs to another "
                    f"version of the shard{fix}",
                    url=url,
                )
            name = tokens[j + 3].decode("utf-8", "surrogateescape") if per == 4 else ""
            comps.append(
                Component(tokens[j].decode("utf-8", "surrogateescape"), offset, size, name)
            )
        out.append(comps)
    return out


def index_components(shard: ShardView, url: str) -> list[list[Component]]:
    """Scan a tar shard's headers (skipping data) into index samples.

    Raises:
        CorruptDataError: The tar is truncated or has a corrupt header.
        FormatError: A member is not a regular file, has an unsafe path, or has a name with
            whitespace, which the index format cannot represent.
    """
    samples: list[list[Component]] = []
    last: str | None = None
    for item in scan(shard, url, want_data=False):
        if isinstance(item, Bad):
            raise item.error
        name, kind, type_name, header_offset, data_offset, size, _ = item
        if kind == DIRECTORY:
            continue
        if kind != REGULAR:
            raise FormatError(
                f"member {name!r} is a {type_name}, not a regular file; WebDataset shards may "
                "hold only regular files",
                url=url,
                offset=header_offset,
            )
        split = split_member_name(name)
        if split is None:
            continue
        reason = unsafe_name_reason(name)
        if reason is not None:
            raise FormatError(f"member name {name!r} {reason}", url=url, offset=header_offset)
        if has_index_whitespace(name):
            raise FormatError(
                f"member name {name!r} contains whitespace, which DALI's index format cannot "
                "represent (it splits fields on whitespace); rename the member",
                url=url,
                offset=header_offset,
            )
        key, ext = split
        comp = Component(ext, data_offset, size, name)
        if key != last:
            samples.append([comp])
            last = key
        else:
            samples[-1].append(comp)
    return samples


def build_index(store: Store, key: str) -> bytes:
    """The DALI ``v1.2`` index of an existing tar shard (ours or third-party).

    Reads only the headers (data is skipped by seeking where the stream allows). The bytes equal
    what DALI's ``wds2idx`` writes for ustar and pax archives; for GNU long-name members this
    gives the correct data offsets, where ``wds2idx`` is 1024 bytes early. An archive without
    samples gives ``"v1.2 0\\n"`` (``wds2idx`` refuses it; DALI cannot read such a shard either).

    Raises:
        CorruptDataError: Truncated or corrupt tar.
        FormatError: A member that is not a regular file, has an unsafe or whitespace name.
        ObjectNotFoundError: No shard under ``key``.
    """
    url = store.child_url(key)
    with open_shard(store, key) as shard:
        samples = index_components(shard, url)
    return format_index(samples)
