"""S3 store: ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server (Ceph RGW, MinIO).

Built on boto3 (chosen by measurement against the local Ceph RGW; see
``benchmarks/bench_s3_clients.py``). What a caller must know:

* **Credentials** come from the options (``access_key_id``/``secret_access_key``/``session_token``,
  or ``profile``) or else from boto3's standard chain: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws/credentials`` and ``~/.aws/config``, container and
  instance metadata. They never appear in ``repr``, exception messages or logs; a pickled store carries
  the options it was given (so workers can authenticate), so do not log pickles.
* **Endpoint**: the ``endpoint_url`` option (``fastload --endpoint-url``), else the standard
  environment variables ``AWS_ENDPOINT_URL_S3`` then ``AWS_ENDPOINT_URL``, else ``endpoint_url`` in
  the profile of ``~/.aws/config`` (boto3 >= 1.28 reads those three itself), else AWS. Error
  messages name the endpoint the client really talks to. A server that cannot be reached (a host
  name that does not resolve, a refused connection) is reported as such, naming the endpoint;
  :class:`~fastload.storage.RetryStore` gives up on it within a second unless the server has
  answered before.
* **Addressing**: with an endpoint set (RGW, MinIO) path-style addressing is the default.
* **Retries**: botocore's own retries are off by default (``botocore_max_attempts=1``): one policy,
  :class:`fastload.storage.RetryStore`, owns backoff and the retry budget, so retries do not multiply.
  :func:`fastload.open_store` adds it for ``s3://`` URLs by default (``retry=...`` to change it);
  :class:`S3Store` itself does not retry, and its streamed reader does not resume a broken
  stream: ``RetryStore`` does, at the offset reached.
  Errors that a retry may cure (throttling, 5xx, timeouts, refused or dropped connections, a
  response cut inside its headers or body) are raised as
  :class:`~fastload.errors.TransientStoreError`; 403/404 are not retryable. A response whose
  connection was cut inside its headers, which Python's HTTP client hands on as if it were whole,
  is recognised before botocore parses it (:mod:`._s3_responses`).
* **Atomicity**: ``put`` is one PUT; ``open_writer`` is a multipart upload (objects smaller than one
  part become one PUT on commit). S3 makes either visible whole, at completion. An aborted or failed
  writer aborts its multipart upload, so no parts are left behind.
* **Large reads**: a ``get`` of more than ``parallel_get_threshold`` bytes fetches the rest after
  its first GET (which learns the size) as parallel ranged GETs pinned to the first GET's ETag
  (``If-Match``), so a concurrent overwrite is detected instead of mixed.
* **Listing** uses ``ListObjectsV2`` pages of ``list_page_size`` keys; S3 returns keys in UTF-8 byte
  order, which is the order the :class:`~fastload.storage.Store` contract promises. Zero-byte
  "directory marker" keys ending in ``/`` are skipped.
* **Deleting** a missing key raises :class:`~fastload.errors.ObjectNotFoundError` as the contract says;
  S3 itself treats that as success, so :meth:`S3Store.delete` costs a HEAD plus a DELETE.
* **Processes and threads**: every method may be called from several threads. The boto3 client and
  the thread pool are created lazily in each process (after ``fork`` too); pickling drops them.
  The clients of a process share botocore's parsed data files, which a forked DataLoader worker
  inherits, so its client costs ~0.015 CPU-s instead of ~0.13.
* **Latency of small reads**: every GET response's socket is told to acknowledge at once
  (``TCP_QUICKACK``, :func:`~fastload.storage._s3_connection.ack_now`). Servers that send the
  headers and a short body in two writes with Nagle's algorithm on (Ceph RGW's beast frontend
  unless ``tcp_nodelay=1``) otherwise wait for Linux's delayed acknowledgement: 40 ms more per
  GET of an index, a manifest or a sample's range.

The store is split by job: :mod:`._s3_config` (options, endpoint, client),
:mod:`._s3_errors` (botocore errors to fastload errors), :mod:`._s3_connection` (per-process client
and pool, requests), :mod:`._s3_reader` and :mod:`._s3_writer` (streams); this module is the
:class:`~fastload.storage.Store` on top.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from fastload.errors import InvalidArgumentError, InvalidRangeError, StoreError
from fastload.storage._base import ObjectWriter, Store
from fastload.storage._keys import ByteRange, ObjectMeta, check_range, validate_key, validate_prefix
from fastload.storage._s3_config import (
    CONFIG_FIELDS,
    MAX_SINGLE_PUT,
    MIN_PART_SIZE,
    MiB,
    S3Config,
)
from fastload.storage._s3_connection import S3Connection, ack_now
from fastload.storage._s3_errors import etag_of
from fastload.storage._s3_reader import S3StreamReader
from fastload.storage._s3_writer import S3Writer

__all__ = ["MIN_PART_SIZE", "S3Config", "S3Store"]

_T = TypeVar("_T")


class S3Store(Store):
    """Objects under ``prefix`` in one S3 bucket.

    Args:
        bucket: Bucket name.
        prefix: Key prefix inside the bucket (a "directory"; slashes at its ends are ignored).
        config: Options; fields given as keyword ``options`` override it.
        **options: Any :class:`S3Config` field.

    Raises:
        InvalidArgumentError: Unknown option or invalid value; the message lists what is accepted.
    """

    def __init__(
        self, bucket: str, prefix: str = "", config: S3Config | None = None, **options: Any
    ) -> None:
        unknown = set(options) - CONFIG_FIELDS
        if unknown:
            raise InvalidArgumentError(
                f"unknown s3 store option(s) {sorted(unknown)}; accepted: {sorted(CONFIG_FIELDS)}"
            )
        if not bucket or "/" in bucket:
            raise InvalidArgumentError(f"invalid bucket name {bucket!r}; use s3://bucket/prefix")
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._key_prefix = self._prefix + "/" if self._prefix else ""
        self.config = dataclasses.replace(config or S3Config(), **options)
        super().__init__(read_only=self.config.read_only)
        self._conn = S3Connection(self.url, bucket, self.config)

    #: :func:`fastload.open_store` wraps S3 stores in a :class:`~fastload.storage.RetryStore` unless
    #: told otherwise (``retry=False``), since networks and servers fail transiently.
    default_retry: ClassVar[bool] = True

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Store:
        """Open ``s3://bucket/prefix`` as a bare store (what :func:`fastload.open_store` calls;
        it adds the retries, concurrency limit and cache).

        Args:
            url: ``s3://bucket`` or ``s3://bucket/prefix``.
            **options: :class:`S3Config` fields.
        """
        return cls._parse(url, **options)

    @classmethod
    def _parse(cls, url: str, **options: Any) -> S3Store:
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3" or not parts.netloc:
            raise InvalidArgumentError(f"not an s3://bucket/prefix URL: {url!r}")
        if "@" in parts.netloc:  # do not echo the URL: it holds credentials
            raise InvalidArgumentError(
                "s3 URLs take no credentials (s3://KEY:SECRET@bucket); pass access_key_id and "
                "secret_access_key options or use the standard AWS credential chain"
            )
        if parts.query or parts.fragment:
            raise InvalidArgumentError(
                f"s3 URLs take no query or fragment: {url!r}; pass options instead"
            )
        return cls(parts.netloc, parts.path, **options)

    # ---- identity, pickling, per-process resources ----------------------------------------------

    @property
    def url(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket

    @property
    def prefix(self) -> str:
        """The key prefix inside the bucket, without slashes at its ends (``""`` for none)."""
        return self._prefix

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._bucket, self._prefix, self.config))

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self._endpoint()!r}" if self.config.endpoint_url else ""
        return f"S3Store({self.url!r}{endpoint})"

    def _endpoint(self) -> str:
        """The endpoint requests go to, for messages, without any user:password part."""
        return self._conn.endpoint()

    def _client(self) -> Any:
        return self._conn.client()

    def close(self) -> None:
        """Drop this process's client and thread pool; they are recreated on next use."""
        self._conn.close()

    def _full_key(self, key: str) -> str:
        return self._key_prefix + validate_key(key, url=self.url)

    def _call(self, action: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """``fn()`` with its errors translated; ``key`` (``None``: the store) names what failed."""
        return self._conn.call(action, self.child_url(key) if key is not None else self.url, fn)

    # ---- reads ----------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectMeta:
        full = self._full_key(key)
        resp = self._call(
            "head", key, lambda: self._client().head_object(Bucket=self._bucket, Key=full)
        )
        return ObjectMeta(
            key,
            int(resp["ContentLength"]),
            resp["LastModified"].timestamp() if resp.get("LastModified") else None,
            etag_of(resp.get("ETag")),
        )

    def _get_object(
        self, key: str, full: str, start: int, end: int | None, etag: str | None = None
    ) -> tuple[bytes, int, str | None]:
        """One GET of ``[start, end)`` (``end=None``: to the end, no Range header when start=0).

        Returns (bytes, total object size, etag). Raises InvalidRangeError without the size.
        """
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": full}
        if end is not None:
            kwargs["Range"] = f"bytes={start}-{end - 1}"
        elif start:
            kwargs["Range"] = f"bytes={start}-"
        if etag:
            kwargs["IfMatch"] = f'"{etag}"'

        def fetch() -> tuple[bytes, int, str | None]:
            resp = self._client().get_object(**kwargs)
            ack_now(resp["Body"])
            data = resp["Body"].read()
            content_range = resp.get("ContentRange")
            total = int(content_range.rpartition("/")[2]) if content_range else len(data)
            return data, total, etag_of(resp.get("ETag"))

        return self._call("read", key, fetch)

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        full = self._full_key(key)
        url = self.child_url(key)
        cfg = self.config
        if byte_range is not None and byte_range.length == 0:
            # No GET can express an empty range; HEAD checks existence and the bound.
            check_range(byte_range, self.head(key).size, url=url)
            return b""
        # The first GET covers the whole object (or range) when it is at most the threshold, so
        # most gets are one request with no copy; it also returns the size and the ETag that pins
        # the parallel GETs of larger objects.
        start = byte_range.start if byte_range else 0
        if byte_range is None:
            first_end = cfg.parallel_get_threshold
        elif byte_range.length <= cfg.parallel_get_threshold:
            first_end = byte_range.end
        else:
            first_end = start + cfg.parallel_get_part_size
        try:
            first, total, etag = self._get_object(key, full, start, first_end)
        except InvalidRangeError:
            if byte_range is None:  # an empty object has no byte 0: plain GET
                return self._get_object(key, full, 0, None)[0]
            check_range(byte_range, self.head(key).size, url=url)
            raise
        if byte_range is not None:
            check_range(byte_range, total, url=url)  # RGW and S3 answer a short body, not 416
        end = byte_range.end if byte_range is not None else total
        if start + len(first) >= end:
            return first
        return self._parallel_get(key, full, first, start + len(first), end, etag)

    def _parallel_get(
        self, key: str, full: str, first: bytes, pos: int, end: int, etag: str | None
    ) -> bytes:
        step = self.config.parallel_get_part_size
        pool = self._conn.pool()
        futures = [
            pool.submit(self._get_object, key, full, lo, min(lo + step, end), etag)
            for lo in range(pos, end, step)
        ]
        parts = [first]
        try:
            for fut in futures:
                parts.append(fut.result()[0])
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        return b"".join(parts)

    def open_reader(self, key: str, *, chunk_size: int = 0) -> io.BufferedIOBase:
        """Stream the object with one GET; a seek re-requests from the new offset.

        The reader is seekable (a seek re-requests from the new offset) and pinned to the ETag seen
        when it opened: if the object is replaced meanwhile, reading raises :class:`StoreError`.
        ``chunk_size`` is the reader's buffer size, at most 1 MiB (the default; reads of more
        than the buffer go straight to the stream, without a copy through it). One thread per
        reader. A broken stream raises :class:`~fastload.errors.TransientStoreError`; under
        :class:`~fastload.storage.RetryStore` (the default of :func:`fastload.open_store`) it is
        resumed where it broke.

        Raises:
            ObjectNotFoundError: The key does not exist (raised here, not at the first read).
        """
        raw = S3StreamReader(self._conn, self.child_url(key), self._full_key(key))
        return io.BufferedReader(raw, buffer_size=min(chunk_size or MiB, MiB))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        validate_prefix(prefix, url=self.url)
        cut = len(self._key_prefix)
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Prefix": self._key_prefix + prefix,
            "MaxKeys": self.config.list_page_size,
        }
        while True:
            page: dict[str, Any] = self._call(
                "list", None, functools.partial(self._client().list_objects_v2, **kwargs)
            )
            for item in page.get("Contents", ()):
                full: str = item["Key"]
                if full.endswith("/"):
                    continue  # "directory" marker objects made by consoles and some tools
                modified = item.get("LastModified")
                yield ObjectMeta(
                    full[cut:],
                    int(item["Size"]),
                    modified.timestamp() if modified else None,
                    etag_of(item.get("ETag")),
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            kwargs["ContinuationToken"] = token

    # ---- writes ---------------------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._check_writable(key)
        full = self._full_key(key)
        view = memoryview(data).cast("B")
        if view.nbytes >= self.config.multipart_threshold or view.nbytes > MAX_SINGLE_PUT:
            with self.open_writer(key) as writer:
                writer.write(view)
            return
        body = data if isinstance(data, bytes | bytearray) else view.tobytes()
        self._call(
            "write",
            key,
            lambda: self._client().put_object(Bucket=self._bucket, Key=full, Body=body),
        )

    def open_writer(self, key: str) -> ObjectWriter:
        """Start a multipart upload of ``key`` (lazily: nothing is sent until a part is full).

        Memory: up to ``upload_concurrency + 1`` parts of ``part_size`` bytes are held; see
        :class:`~fastload.storage._s3_writer.S3Writer`.
        """
        self._check_writable(key)
        return S3Writer(self._conn, self.child_url(key), self._full_key(key))

    def delete(self, key: str) -> None:
        self._check_writable(key)
        full = self._full_key(key)
        self.head(key)  # S3 deletes of missing keys succeed; the contract says they raise
        self._call(
            "delete", key, lambda: self._client().delete_object(Bucket=self._bucket, Key=full)
        )

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete keys in batches of 1000 (``DeleteObjects``); missing keys are ignored."""
        batch: builtins.list[str] = []
        for key in keys:
            self._check_writable(key)
            batch.append(self._full_key(key))
            if len(batch) == 1000:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def abort_incomplete_writes(self, prefix: str = "") -> builtins.list[str]:
        """Abort every unfinished multipart upload of a key under ``prefix``; return their keys.

        A writer killed before it completed or aborted its upload leaves the upload (and its
        parts, which the bucket bills for) behind, invisible to :meth:`list`. Call this only when
        no live writer uses those keys: their uploads would be aborted too, and their
        ``close()`` would fail. Listing is paginated.
        """
        validate_prefix(prefix, url=self.url)
        cut = len(self._key_prefix)
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Prefix": self._key_prefix + prefix}
        aborted: builtins.list[str] = []
        while True:
            page: dict[str, Any] = self._call(
                "list", None, functools.partial(self._client().list_multipart_uploads, **kwargs)
            )
            for upload in page.get("Uploads", ()):
                full, upload_id = upload["Key"], upload["UploadId"]
                self._call(
                    "write",
                    full[cut:],
                    functools.partial(
                        self._client().abort_multipart_upload,
                        Bucket=self._bucket,
                        Key=full,
                        UploadId=upload_id,
                    ),
                )
                aborted.append(full[cut:])
            if not page.get("IsTruncated"):
                return aborted
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def _delete_batch(self, full_keys: builtins.list[str]) -> None:
        request = {"Objects": [{"Key": k} for k in full_keys], "Quiet": True}
        resp = self._call(
            "delete",
            None,
            lambda: self._client().delete_objects(Bucket=self._bucket, Delete=request),
        )
        errors = [e for e in resp.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise StoreError(
                f"could not delete {len(errors)} object(s) of {self.url}, e.g. "
                f"{first.get('Key')!r}: {first.get('Code')}",
                url=self.url,
            )


def _rebuild(bucket: str, prefix: str, config: S3Config) -> S3Store:
    return S3Store(bucket, prefix, config)
