"""DALI-compatible WebDataset index files (the format DALI's ``wds2idx`` tool writes).

Text, ``\\n``-terminated lines::

    v1.2 <num_samples>
    <ext> <data_offset> <size> <member_name>[ <ext> <data_offset> <size> <member_name>]...

one line per sample, components in tar order. See this package's ``README.md`` for every rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fastload.errors import CorruptDataError, FormatError
from fastload.formats.webdataset._compact import Component, SampleIndex, parse_uniform
from fastload.formats.webdataset._scan import DIRECTORY, REGULAR, Bad, Member, scan
from fastload.formats.webdataset._source import open_shard, scan_shard
from fastload.formats.webdataset._tar import BLOCK, split_member_name, unsafe_name_reason
from fastload.formats.webdataset._view import ShardView
from fastload.storage import Store

__all__ = [
    "Component",
    "SampleIndex",
    "build_index",
    "components_of",
    "format_index",
    "has_index_whitespace",
    "headers_index",
    "load_index",
    "member_problem",
    "parse_index",
]

INDEX_VERSION = "v1.2"
_ASCII_WHITESPACE = frozenset(" \t\n\v\f\r")
_FIX = "; the index is damaged or stale: rebuild it with `fastload index`"


def has_index_whitespace(text: str) -> bool:
    """Whether ``text`` has a character that DALI's index reader treats as a separator."""
    return not _ASCII_WHITESPACE.isdisjoint(text)


def format_index(samples: Iterable[Sequence[Component]]) -> bytes:
    """Serialise samples' components as a ``v1.2`` index, byte for byte as ``wds2idx`` does."""
    lines = [" ".join(f"{c.ext} {c.offset} {c.size} {c.name}" for c in comps) for comps in samples]
    text = f"{INDEX_VERSION} {len(lines)}\n" + "".join(line + "\n" for line in lines)
    return text.encode("utf-8", "surrogateescape")


def load_index(data: bytes, *, url: str = "", shard_size: int | None = None) -> SampleIndex:
    """Parse a ``v1.2`` (or ``v1.1``) WebDataset index into its compact form and check that it can
    describe a shard.

    Besides the syntax, the index must be consistent with itself, so that reading by it delivers
    every sample of the shard once: components lie in increasing byte order without overlapping
    (each member's 512-byte header lies after the previous member's data), and, for ``v1.2``
    lines, which name their members, the components of a line share one sample key, their fields
    differ, the field matches the name, and two consecutive lines have different keys (a reader
    would group them into one sample). A duplicated, reordered or spliced line fails here.

    The common shape (single spaces, the same fields on every line) is parsed in vectorised
    passes (~0.2 s for 100,000 samples of two fields, a quarter of the line-by-line parse); any
    other index line by line under the same rules.

    Args:
        data: The index file's bytes.
        url: The index URL, for messages.
        shard_size: If given, every component must lie within a shard of this many bytes.

    Raises:
        CorruptDataError: The index is malformed, has another version, its sample count line
            disagrees with its lines, or it is inconsistent as above; the message names the
            line and says to rebuild it with ``fastload index``.
    """
    if data and not data.endswith(b"\n"):  # cut inside its last line, which may still parse
        raise CorruptDataError(
            f"WebDataset index does not end with a newline: it is truncated{_FIX}", url=url
        )
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise CorruptDataError(f"WebDataset index is empty{_FIX}", url=url)
    head = lines[0].split()
    if len(head) != 2 or head[0] not in (b"v1.1", b"v1.2") or not head[1].isdigit():
        raise CorruptDataError(
            f"WebDataset index header {lines[0][:40]!r} is not 'v1.2 <num_samples>' "
            f"(or 'v1.1 <num_samples>'){_FIX}",
            url=url,
        )
    per = 4 if head[0] == b"v1.2" else 3
    count = int(head[1])
    if count != len(lines) - 1:
        raise CorruptDataError(
            f"WebDataset index declares {count} samples but has {len(lines) - 1} sample lines{_FIX}",
            url=url,
        )
    index = parse_uniform(data, lines[1:]) if per == 4 else None
    if index is None:
        index = SampleIndex.from_samples(_parse_lines(lines, per, url))
    if shard_size is not None:
        index.check_bound(shard_size, url)
    return index


def parse_index(
    data: bytes, *, url: str = "", shard_size: int | None = None
) -> list[list[Component]]:
    """:func:`load_index` as a list of samples, each a list of its :class:`Component` in shard
    order (~250 bytes a sample; readers keep the compact form).

    Raises:
        CorruptDataError: As :func:`load_index`.
    """
    return load_index(data, url=url, shard_size=shard_size).samples()


def _parse_lines(lines: list[bytes], per: int, url: str) -> list[list[Component]]:
    """The sample lines (``lines[1:]``) parsed one by one (:func:`load_index`'s rules)."""
    out: list[list[Component]] = []
    end = 0  # where the previous member's data ends, padded to a block
    previous_key: str | None = None
    for lineno, line in enumerate(lines[1:], start=2):
        tokens = line.split()
        if not tokens or len(tokens) % per:
            raise CorruptDataError(
                f"WebDataset index line {lineno} has {len(tokens)} fields, expected a multiple of "
                f"{per} (<ext> <offset> <size>{' <name>' if per == 4 else ''}){_FIX}",
                url=url,
            )
        comps: list[Component] = []
        key: str | None = None
        for j in range(0, len(tokens), per):
            try:
                offset, size = int(tokens[j + 1]), int(tokens[j + 2])
            except ValueError:
                offset = size = -1
            if offset < BLOCK or size < 0 or offset % BLOCK:
                raise CorruptDataError(
                    f"WebDataset index line {lineno}: component {j // per} has offset "
                    f"{tokens[j + 1]!r:.40} and size {tokens[j + 2]!r:.40}; offsets are positive "
                    f"multiples of 512 and sizes non-negative{_FIX}",
                    url=url,
                )
            if offset - BLOCK < end:
                raise CorruptDataError(
                    f"WebDataset index line {lineno}: component {j // per} at byte offset "
                    f"{offset} overlaps or precedes the member before it (which ends at byte "
                    f"{end}); index lines must follow the shard's member order{_FIX}",
                    url=url,
                )
            end = offset + size + (-size % BLOCK)
            ext = tokens[j].decode("utf-8", "surrogateescape")
            name = tokens[j + 3].decode("utf-8", "surrogateescape") if per == 4 else ""
            if name:
                problem = _name_problem(name, ext, key, comps)
                if problem:
                    raise CorruptDataError(
                        f"WebDataset index line {lineno}: member {name!r} {problem}; either the "
                        "index is damaged (rebuild it with `fastload index`) or the shard holds "
                        "such a member and cannot be used as it is (`fastload verify` tells which)",
                        url=url,
                    )
                key = name[: len(name) - len(ext) - 1]
            comps.append(Component(ext, offset, size, name))
        if key is not None and key == previous_key:
            raise CorruptDataError(
                f"WebDataset index lines {lineno - 1} and {lineno} both hold sample {key!r}; "
                f"consecutive members of one sample belong on one line{_FIX}",
                url=url,
            )
        previous_key = key
        out.append(comps)
    return out


def member_problem(name: str, field: str) -> str | None:
    """Why a regular-file member named ``name`` with field ``field`` cannot be part of a sample,
    or ``None``. One rule for every read path (streaming, indexed, ``fastload index``): the path
    must be relative and stay inside the archive, and the field must not be in the ``__``
    namespace of sample metadata (``__key__``, ``__url__``, ...)."""
    reason = unsafe_name_reason(name)
    if reason is not None:
        return f"{reason}; refusing it as unsafe"
    if not field:
        return "has an empty field name (it ends with '.')"
    if field.startswith("__"):
        return (
            f"uses the reserved field name {field!r} (fields starting with '__' are sample "
            "metadata such as __key__)"
        )
    return None


def _name_problem(name: str, ext: str, key: str | None, comps: list[Component]) -> str:
    """What is wrong with an index component's member name, or ``""``."""
    split = split_member_name(name)
    if split is None or split[1] != ext:
        return f"does not have field {ext!r}"
    problem = member_problem(name, ext)
    if problem is not None:
        return problem
    if key is not None and split[0] != key:
        return f"belongs to sample {split[0]!r}, not to {key!r} as the line's first member"
    if any(c.ext == ext for c in comps):
        return f"repeats field {ext!r} in one sample"
    return ""


def index_components(shard: ShardView, url: str) -> list[list[Component]]:
    """Scan a tar shard's headers (skipping data) into index samples.

    Raises:
        CorruptDataError: The tar is truncated or has a corrupt header.
        FormatError: A member is not a regular file, has an unsafe path, or has a name with
            whitespace, which the index format cannot represent.
    """
    return components_of(scan(shard, url, want_data=False), url)


def components_of(members: Iterable[Member | Bad], url: str) -> list[list[Component]]:
    """The index samples of a tar's ``members`` (as :func:`scan` yields them, in order);
    raises as :func:`index_components` does."""
    samples: list[list[Component]] = []
    last: str | None = None
    for item in members:
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
        problem = member_problem(name, split[1])
        if problem is not None:
            raise FormatError(f"member {name!r} {problem}", url=url, offset=header_offset)
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
        elif any(c.ext == ext for c in samples[-1]):
            raise FormatError(
                f"field {ext!r} appears twice in sample {key!r} (member {name!r}); each "
                "sample's members must have distinct extensions",
                url=url,
                offset=header_offset,
            )
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


def headers_index(store: Store, key: str, url: str, expected: int | None) -> SampleIndex:
    """An index built from a shard's own headers, replacing a damaged index file (readers do so
    under ``skip``/``warn``: the shard is intact, so its samples are kept).

    The scan stops at the first damage in the shard itself (a reader then reports the samples
    after it missing one by one); at most ``expected`` samples (the manifest's count) are kept.
    """
    samples: list[list[Component]] = []
    last: str | None = None
    with open_shard(store, key) as shard:
        for item in scan_shard(shard, url, want_data=False):
            if isinstance(item, Bad):
                break
            name, kind, _, _, data_offset, size, _ = item
            split = split_member_name(name) if kind == REGULAR else None
            if split is None:
                continue
            comp = Component(split[1], data_offset, size, name)
            if split[0] != last:
                samples.append([comp])
                last = split[0]
            else:
                samples[-1].append(comp)
    if expected is not None and len(samples) > expected:
        del samples[expected:]
    return SampleIndex.from_samples(samples)
