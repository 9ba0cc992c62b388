"""The S3 store's streamed writer: a multipart upload, or one PUT for a small object."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from fastload.errors import TransientStoreError
from fastload.storage._base import ObjectWriter
from fastload.storage._s3_connection import S3Connection

__all__ = ["S3Writer"]

_log = logging.getLogger("fastload.storage._s3")
_T = TypeVar("_T")


class S3Writer(ObjectWriter):
    """Multipart upload with bounded parallel part uploads; one PUT if it never fills a part.

    Memory: up to ``upload_concurrency + 1`` parts of ``part_size`` bytes are held. Each request
    (start, part, completion, or the one PUT) that fails transiently is sent again
    (``part_attempts`` in all), since a streamed write cannot be replayed whole by
    :class:`~fastload.storage.RetryStore`. An aborted or failed writer aborts
    its multipart upload, so no parts are left behind.

    Args:
        conn: The store's connection.
        url: The object's URL, for messages.
        full: The object's key in the bucket.
    """

    def __init__(self, conn: S3Connection, url: str, full: str) -> None:
        super().__init__()
        self._conn, self._url, self._full = conn, url, full
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []

    def _client(self) -> Any:
        return self._conn.client()

    def _write(self, data: memoryview) -> None:
        part = self._conn.config.part_size
        pos = 0
        if self._buf:  # top up the pending part first
            pos = min(part - len(self._buf), data.nbytes)
            self._buf += data[:pos]
            if len(self._buf) < part:
                return
            chunk, self._buf = bytes(self._buf), bytearray()
            self._submit(chunk)
        while data.nbytes - pos >= part:  # whole parts straight from the caller's buffer
            self._submit(data[pos : pos + part].tobytes())
            pos += part
        self._buf += data[pos:]

    def _submit(self, chunk: bytes) -> None:
        conn = self._conn
        if self._upload_id is None:
            resp = self._attempts(
                "start a multipart upload of",
                lambda: self._client().create_multipart_upload(Bucket=conn.bucket, Key=self._full),
            )
            self._upload_id = str(resp["UploadId"])
        # Bound memory: wait for the oldest part when too many are in flight.
        pending = [f for f in self._parts if not f.done()]
        limit = conn.config.upload_concurrency
        for fut in pending[: max(0, len(pending) - limit + 1)]:
            fut.result()
        for fut in self._parts:
            if fut.done():
                fut.result()  # surface a failed part now
        number = len(self._parts) + 1
        upload_id = self._upload_id
        self._parts.append(conn.pool().submit(self._upload_part, number, upload_id, chunk))

    def _attempts(self, action: str, fn: Callable[[], _T], *, what: str = "") -> _T:
        """``fn()`` (one request), repeated on transient errors up to ``part_attempts`` times
        with backoff: :class:`~fastload.storage.RetryStore` cannot replay a streamed write, so
        each of its requests is retried here. Every request retried so is idempotent (a part
        number uploaded again replaces the part; a PUT of the same bytes; a completion, see
        :meth:`_complete`). A new multipart upload whose answer was lost leaves an empty upload
        behind, which :meth:`~fastload.storage.S3Store.abort_incomplete_writes` removes."""
        attempts = self._conn.config.part_attempts
        for attempt in range(1, attempts + 1):
            try:
                return self._conn.call(action, self._url, fn)
            except TransientStoreError as exc:
                if attempt == attempts:
                    raise
                delay = min(0.2 * 2**attempt, 5.0)
                _log.info(
                    "retrying (%d/%d) in %.2g s: %s%s: %s",
                    attempt,
                    attempts - 1,
                    delay,
                    what,
                    self._url,
                    " ".join(str(exc).split()),
                )
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _upload_part(self, number: int, upload_id: str, chunk: bytes) -> dict[str, Any]:
        conn = self._conn
        resp = self._attempts(
            f"upload part {number} of",
            lambda: self._client().upload_part(
                Bucket=conn.bucket,
                Key=self._full,
                UploadId=upload_id,
                PartNumber=number,
                Body=chunk,
            ),
            what=f"part {number} of ",
        )
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _commit(self) -> None:
        conn = self._conn
        if self._upload_id is None:
            body = bytes(self._buf)
            self._buf = bytearray()
            self._attempts(
                "write",
                lambda: self._client().put_object(Bucket=conn.bucket, Key=self._full, Body=body),
            )
            return
        if self._buf:
            chunk = bytes(self._buf)
            self._buf = bytearray()
            self._submit(chunk)
        parts = [fut.result() for fut in self._parts]
        self._complete(self._upload_id, parts)
        self._upload_id = None

    def _complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None:
        """Complete the upload. A completion whose answer was lost may have completed it: a
        retry then finds no such upload, and the object's ETag, the MD5 of the parts' MD5s
        with the part count (what S3 and Ceph RGW compute), tells whether it is this upload."""
        conn = self._conn
        failed = False

        def complete() -> None:
            nonlocal failed
            try:
                self._client().complete_multipart_upload(
                    Bucket=conn.bucket,
                    Key=self._full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as exc:
                code = getattr(exc, "response", {}).get("Error", {}).get("Code")
                if failed and code == "NoSuchUpload" and self._is_completed(parts):
                    return
                failed = True
                raise

        self._attempts("complete the multipart upload of", complete)

    def _is_completed(self, parts: list[dict[str, Any]]) -> bool:
        """Whether the object now is the one these parts make (see :meth:`_complete`)."""
        try:
            digests = b"".join(bytes.fromhex(str(p["ETag"]).strip('"')) for p in parts)
        except ValueError:  # not MD5 ETags (encrypted buckets): cannot tell
            return False
        expected = f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"
        head = self._client().head_object(Bucket=self._conn.bucket, Key=self._full)
        return str(head.get("ETag", "")).strip('"') == expected

    def _abort(self) -> None:
        self._buf = bytearray()
        for fut in self._parts:
            fut.cancel()
        for fut in self._parts:
            try:
                fut.exception()  # wait for parts in flight so that abort removes them all
            except BaseException:
                pass
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        try:
            self._client().abort_multipart_upload(
                Bucket=self._conn.bucket, Key=self._full, UploadId=upload_id
            )
        except Exception as exc:  # must not raise; say what is left behind
            _log.warning(
                "could not abort multipart upload of %s (%s); an S3 lifecycle rule for incomplete "
                "multipart uploads will clean it up",
                self._url,
                type(exc).__name__,
            )
