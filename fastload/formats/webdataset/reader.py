"""The WebDataset shard reader: streams tar members from a store and groups them into samples."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator
from typing import Any, Unpack

from fastload.errors import CorruptDataError, FormatError, MissingIndexError, ObjectNotFoundError
from fastload.formats import _cache
from fastload.formats._base import DAMAGED_SHARD_REMEDY, ReaderOptions, ShardReader
from fastload.formats._mmap import local_file, map_file
from fastload.formats.webdataset._checks import check_indexed_header
from fastload.formats.webdataset._compact import CODEC as INDEX_CODEC
from fastload.formats.webdataset._compressed import (
    HEAD_BYTES,
    InflatedView,
    compressed_name,
    compression_of,
)
from fastload.formats.webdataset._scan import DIRECTORY, REGULAR, Bad, Member
from fastload.formats.webdataset._source import open_shard, scan_shard
from fastload.formats.webdataset._tar import BLOCK, split_member_name
from fastload.formats.webdataset._view import ShardView
from fastload.formats.webdataset.index import (
    SampleIndex,
    components_of,
    format_index,
    headers_index,
    load_index,
    member_problem,
)
from fastload.storage import ByteRange, Store

__all__ = ["WebDatasetReader"]


class WebDatasetReader(ShardReader):
    """Reads a tar shard: sequentially by streaming, and by position when it has an index.

    Iteration yields ``{"__key__", "__url__", "__index__", field: bytes}``. A shard that is a
    local file (``store.has_local_paths``) is memory-mapped, so each field's bytes are copied
    once, from the page cache into the ``bytes`` returned; any other shard is streamed through
    ``store.open_reader`` (never downloaded whole or held in memory). A mapped shard must not be
    truncated in place while it is read (``SIGBUS``); replacing it atomically, as fastload's
    stores do, is safe.
    Consecutive members with the same basename (the member path up to the first ``.`` after
    the last ``/``) form one sample; the rest of the name is the field. Directories, members
    without a ``.`` in their last path segment and hidden files (``.foo``) are ignored.

    Refused, as :class:`~fastload.errors.CorruptDataError` naming the shard URL, member and
    byte offset: members that are not regular files (links, devices, FIFOs), member names that
    are absolute or contain ``..``, a field that appears twice in one sample, bad header
    checksums, and truncated archives. Under ``on_error="skip"``/``"warn"`` the sample
    concerned is dropped and counted in :attr:`skipped`; after a corrupt header the reader
    resumes at the next valid header (the samples on both sides of it are dropped, as either may
    have lost the member it described); a truncated archive ends the iteration.

    With an index (``index_key``, or ``key + ".idx"`` when it exists), :meth:`__len__`,
    :meth:`read` (slices of a memory map for local shards, else one coalesced ranged request per
    sample) and a seeking :meth:`iter_from` work, and :attr:`supports_random_access` is True.
    The index is loaded on first use and checked against the shard's size; every random read
    checks the member headers in front of the data it fetches, so a stale index raises instead
    of returning wrong bytes.

    A compressed shard (a tar inside one gzip, bzip2 or xz stream: ``.tar.gz``/``.tgz``,
    ``.tar.bz2``, ``.tar.xz``, recognised by its first bytes) is streamed through a
    decompressor, from a local file or any store, and yields the samples of the tar inside it
    under the same rules. It has no random access: no index is looked up for names with those
    suffixes, and :meth:`__len__`/:meth:`read` raise :class:`~fastload.errors.MissingIndexError`
    saying so; :meth:`iter_from` skips. Byte offsets in its errors are offsets in the
    decompressed stream; a decompression error ends the shard like a truncated archive.

    A reader is not thread-safe; pickling it is cheap (the store and key; no open files, no
    maps, no index). :meth:`close` unmaps what :meth:`read` mapped.
    ``__index__`` is the sample's position among the samples found in the shard, which equals
    its index line when the shard is intact.
    """

    def __init__(self, store: Store, key: str, **options: Unpack[ReaderOptions]) -> None:
        super().__init__(store, key, **options)
        self._index: SampleIndex | None = None
        self._index_loaded = False
        self._map: ShardView | None = None  # this process's map of a local shard, for read()
        self._map_tried = False
        self._map_bytes: memoryview | None = None  # the map as a memoryview, for views
        self._size = -1  # the shard's size when the index was loaded
        self._names_checked = True  # load_index checked the member names of the index

    def __getstate__(self) -> dict[str, Any]:
        # Workers reload the index and map the shard lazily instead of receiving copies.
        state = self.__dict__.copy()
        state["_index"], state["_index_loaded"] = None, False
        state["_map"], state["_map_tried"], state["_map_bytes"] = None, False, None
        state["_names_checked"] = True
        return state

    def close(self) -> None:
        """Unmap the shard if :meth:`read` mapped it. The reader stays usable. Views from
        :meth:`read_view` stay valid: the mapping goes with the last of them."""
        view, self._map, self._map_tried = self._map, None, False
        whole, self._map_bytes = self._map_bytes, None
        if whole is not None:
            whole.release()
        if isinstance(view, mmap.mmap):
            with contextlib.suppress(BufferError):  # BufferError: views alive, they keep it
                view.close()

    # ---- index --------------------------------------------------------------------------------

    def _load_index(self) -> SampleIndex | None:
        if self._index_loaded:
            return self._index
        if compressed_name(self.key):  # offsets into a compressed tar mean nothing: no index
            self._index, self._index_loaded = None, True
            return None
        ikey = self.index_key if self.index_key is not None else self.key + ".idx"
        iurl = self.store.child_url(ikey)
        shard_path, index_path = local_file(self.store, self.key), local_file(self.store, ikey)
        index: SampleIndex | None
        try:
            found = None
            if shard_path is not None and index_path is not None:  # parsed once per process
                try:
                    found = _cache.cached(
                        "webdataset",
                        shard_path,
                        index_path,
                        lambda d, _: load_index(d, url=iurl),
                        INDEX_CODEC,
                    )
                except FileNotFoundError:  # a cache evicted the file: read through the store
                    found = None
            if found is not None:
                index, stamp = found
                self._size = stamp.size
                index.check_bound(self.index_bound(self._size), iurl)
            else:
                index = self._fetch_index(ikey, iurl)
            if index is not None:
                self.check_index_count(len(index), iurl)
        except CorruptDataError as exc:
            self.index_damaged(exc, "member headers")
            self._size = self.store.size(self.key)
            index = headers_index(self.store, self.key, self.url, self.expected_samples)
            self._names_checked = False  # read() checks each sample's names as it reads it
        self._index, self._index_loaded = index, True
        return index

    def _fetch_index(self, ikey: str, iurl: str) -> SampleIndex | None:
        """The index read through the store (not cached), or ``None`` when there is none."""
        try:
            data = self.store.get(ikey)
        except ObjectNotFoundError:
            if self.index_key is not None:
                raise ObjectNotFoundError(
                    f"index {iurl} of shard {self.url} does not exist; build it with "
                    "`fastload index`, or pass index_key=None to read without one",
                    url=iurl,
                ) from None
            return None
        self._size = size = self.store.size(self.key)
        return load_index(data, url=iurl, shard_size=self.index_bound(size))

    def _compression(self) -> str | None:
        """The shard's compression from its first bytes (for messages; one small read)."""
        try:
            size = self.store.size(self.key)
            head = self.store.get(self.key, ByteRange(0, min(size, HEAD_BYTES)))
        except (OSError, FormatError):
            return None
        return compression_of(head)

    @property
    def supports_random_access(self) -> bool:  # type: ignore[override]
        """True when the shard has an index (looked up, and loaded, on first access)."""
        return self._load_index() is not None

    def _require_index(self) -> SampleIndex:
        index = self._load_index()
        if index is None:
            codec = self._compression()
            if codec is not None:
                raise MissingIndexError(
                    f"shard is a {codec}-compressed tar, which is read in order only: its "
                    "samples cannot be counted or read by position (no index can point into "
                    "it); iterate it, or convert it into indexed shards with `fastload convert "
                    "SRC DST`",
                    url=self.url,
                )
            raise MissingIndexError(
                f"shard has no index {self.key}.idx, so samples cannot be counted or read by "
                "position; build one with `fastload index`",
                url=self.url,
            )
        return index

    def __len__(self) -> int:
        """Number of samples, from the index.

        Raises:
            MissingIndexError: The shard has no index (a :class:`FormatError` and a
                :class:`TypeError`).
        """
        return len(self._require_index())

    def read(self, i: int) -> dict[str, Any]:
        """The ``i``-th sample (``0 <= i < len(self)``).

        A local shard is memory-mapped on the first call (per process; :meth:`close` unmaps
        it) and each field is one copy out of it; other stores get one ranged request per
        sample.

        The error policy does not apply here: a sample that cannot be read raises.

        Raises:
            IndexError: ``i`` is out of range.
            MissingIndexError: No index.
            CorruptDataError: The headers in front of the indexed data do not match the index.
        """
        return self._read(i, views=False)

    def read_view(self, i: int) -> dict[str, Any]:
        """:meth:`read` with the fields of a local (memory-mapped) shard as read-only
        ``memoryview`` slices of the map, not copies (see ``ShardReader.read_view``)."""
        return self._read(i, views=True)

    def _read(self, i: int, *, views: bool) -> dict[str, Any]:
        index = self._require_index()
        if not 0 <= i < len(index):
            missing = self.missing_sample(i, len(index))
            if missing is not None:
                raise missing
            raise IndexError(f"sample {i} out of range: {self.url} has {len(index)} samples")
        comps = index.components(i)
        last = comps[-1]
        if last.offset + last.size > self._size:
            raise self.past_end(i, comps[0].offset - BLOCK, last.offset + last.size, self._size)
        view = self._local_map()
        if view is not None:  # a local file: each field is one copy out of the page cache
            if views and self._map_bytes is None and isinstance(view, mmap.mmap):
                self._map_bytes = memoryview(view)
            src = self._map_bytes if views and self._map_bytes is not None else view
            parts = [
                (view[c.offset - BLOCK : c.offset], src[c.offset : c.offset + c.size])
                for c in comps
            ]
        else:  # one request for the sample's headers and data
            ranges = [ByteRange(c.offset - BLOCK, c.offset + c.size) for c in comps]
            blobs = self.store.get_ranges(self.key, ranges)
            parts = [(blob[:BLOCK], blob[BLOCK:]) for blob in blobs]
        sample: dict[str, Any] = {"__url__": self.url, "__index__": i}
        key: str | None = None
        for comp, (hdr, data) in zip(comps, parts, strict=True):
            name = check_indexed_header(comp, hdr, i, self.url)
            split = split_member_name(name)
            if split is None or split[1] != comp.ext:
                raise CorruptDataError(
                    f"index line {i + 2} lists member {name!r} with field {comp.ext!r}, which "
                    "does not match its name; rebuild the index with `fastload index`",
                    url=self.url,
                    offset=comp.offset,
                )
            if not comp.name or not self._names_checked:  # check what load_index did not
                problem = member_problem(name, comp.ext)
                if problem is None and key is not None and split[0] != key:
                    problem = f"belongs to sample {split[0]!r}, not {key!r}"
                if problem is None and comp.ext in sample:
                    problem = f"repeats field {comp.ext!r} of sample {split[0]!r}"
                if problem is not None:
                    raise CorruptDataError(
                        f"index line {i + 2}: member {name!r} {problem}",
                        url=self.url,
                        offset=comp.offset - BLOCK,
                    )
            if len(data) != comp.size:  # the shard shrank after the index was loaded
                raise CorruptDataError(
                    f"index line {i + 2} gives {comp.size} bytes for {name!r} at byte offset "
                    f"{comp.offset}, but the shard ends after {len(data)} of them: it was "
                    f"truncated while being read{DAMAGED_SHARD_REMEDY}",
                    url=self.url,
                    offset=comp.offset,
                )
            if key is None:
                key = split[0]
                sample["__key__"] = key
            sample[comp.ext] = data
        return sample

    def field_locations(self, field: str) -> list[tuple[int, int]] | None:
        """``(offset, size)`` of member ``KEY.field``'s data in every sample, from the index;
        ``None`` without an index (a compressed shard, or none built).

        Raises:
            KeyError: A sample has no such member (names the sample and the index line).
        """
        index = self._load_index()
        return None if index is None else index.field_locations(field, self.url)

    def _local_map(self) -> ShardView | None:
        """The shard mapped into memory when it is a local file (kept until :meth:`close`)."""
        if not self._map_tried:
            path = local_file(self.store, self.key)
            self._map = None if path is None else map_file(path)
            self._map_tried = True
        return self._map

    # ---- streaming ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield the shard's samples in order, streaming."""
        return self._stream(0, 0)

    def iter_and_index(
        self, build_index: Callable[[Store, str], bytes | None]
    ) -> tuple[Iterator[dict[str, Any]], Callable[[], bytes | None]]:
        """:meth:`ShardReader.iter_and_index`; indexes a whole, undamaged, uncompressed pass."""
        seen: list[Member | Bad] = []
        done = [False]

        def tee(members: Iterator[Member | Bad]) -> Iterator[Member | Bad]:
            for item in members:
                seen.append(item if isinstance(item, Bad) else (*item[:6], None))
                yield item

        def samples() -> Iterator[dict[str, Any]]:
            with open_shard(self.store, self.key, inflate=True) as shard:
                plain = not isinstance(shard, InflatedView)  # else build_index refuses it
                members = scan_shard(shard, self.url)
                yield from self._samples(tee(members) if plain else members, 0)
                done[0] = plain

        def index() -> bytes | None:
            if done[0] and not self.skipped:
                return format_index(components_of(seen, self.url))
            return build_index(self.store, self.key)

        return samples(), index

    def iter_from(self, start: int) -> Iterator[dict[str, Any]]:
        """Yield samples from position ``start`` on; with an index, seeks straight there."""
        if start <= 0:
            return self._stream(0, 0)
        index = self._load_index()
        if index is None:
            return super().iter_from(start)
        if start >= len(index):
            return iter(())
        last = index.components(start - 1)[-1]
        return self._stream(last.offset + last.size + (-last.size % BLOCK), start)

    def _stream(self, offset: int, first: int) -> Iterator[dict[str, Any]]:
        with open_shard(self.store, self.key, inflate=True) as shard:
            members = scan_shard(shard, self.url, start=offset)
            yield from self._samples(members, first)

    def _samples(self, members: Iterator[Member | Bad], first: int) -> Iterator[dict[str, Any]]:
        url = self.url
        policy = self.policy
        raise_now = policy.on_error == "raise"
        key: str | None = None
        sample: dict[str, Any] | None = None
        bad: CorruptDataError | None = None  # why the current sample will be dropped
        lost: CorruptDataError | None = None  # a member before the next one was lost
        position = first - 1
        for item in members:
            if isinstance(item, Bad):
                if raise_now:
                    raise item.error
                if item.fatal:
                    cut = split_member_name(item.member) if item.member is not None else None
                    if sample is not None and cut is not None and cut[0] != key:
                        # cut inside the next sample's member: the open sample is complete
                        if bad is None:
                            yield sample
                        else:
                            policy.handle(bad)
                        sample, bad = None, None
                    policy.handle(bad or item.error)
                    return
                if sample is not None and bad is None:
                    bad = item.error
                if item.lost_next:
                    lost = item.error
                continue
            name, kind, type_name, header_offset, _, _, data = item
            exc: CorruptDataError | None = None
            if kind == REGULAR:
                slash = name.rfind("/")
                dot = name.find(".", slash + 1)
                if dot <= slash + 1:
                    continue  # no extension, or a hidden file: not a sample component
                k, field = name[:dot], name[dot + 1 :]
                if name[0] == "/" or ".." in name or field[:1] in ("_", ""):
                    problem = member_problem(name, field)
                    if problem is not None:
                        exc = CorruptDataError(
                            f"member {name!r} {problem}", url=url, offset=header_offset
                        )
                if exc is None and k == key and sample is not None and field not in sample:
                    sample[field] = data  # the common case: the next field of this sample
                    lost = None
                    continue
            elif kind == DIRECTORY:
                continue
            else:
                exc = CorruptDataError(
                    f"member {name!r} is a {type_name}, not a regular file; WebDataset shards "
                    "may hold only regular files",
                    url=url,
                    offset=header_offset,
                )
                split = split_member_name(name)
                if split is None:
                    if raise_now:
                        raise exc
                    policy.handle(exc)
                    continue
                k, field = split
            if sample is None or k != key:
                if sample is not None:
                    if bad is None:
                        yield sample
                    else:
                        policy.handle(bad)
                key = k
                position += 1
                sample = {"__key__": k, "__url__": url, "__index__": position}
                if lost is not None:
                    bad = CorruptDataError(
                        f"sample {k!r} dropped: a tar header before it was corrupt ({lost})",
                        url=url,
                        offset=header_offset,
                        key=k,
                    )
                    lost = None
                else:
                    bad = None
            else:
                lost = None
            if exc is None and field in sample:
                exc = CorruptDataError(
                    f"field {field!r} appears twice in sample {k!r} (member {name!r}); each "
                    "sample's members must have distinct extensions",
                    url=url,
                    offset=header_offset,
                    key=k,
                )
            if exc is not None:
                if raise_now:
                    raise exc
                if bad is None:
                    bad = exc
                continue
            sample[field] = data
        if sample is not None:
            if bad is None:
                yield sample
            else:
                policy.handle(bad)
