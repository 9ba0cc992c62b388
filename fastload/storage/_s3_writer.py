"""The S3 store's streamed writer: a multipart upload, or one PUT for a small object."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

from fastload.errors import TransientStoreError
from fastload.storage._base import ObjectWriter
from fastload.storage._s3_connection import S3Connection

__all__ = ["S3Writer"]

_log = logging.getLogger("fastload.storage._s3")


class S3Writer(ObjectWriter):
    """Multipart upload with bounded parallel part uploads; one PUT if it never fills a part.

    Memory: up to ``upload_concurrency + 1`` parts of ``part_size`` bytes are held. A part that
    fails transiently is uploaded again (``part_attempts``), since a streamed write cannot be
    replayed whole by :class:`~fastload.storage.RetryStore`. An aborted or failed writer aborts
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
            resp = conn.call(
                "start a multipart upload of",
                self._url,
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

    def _upload_part(self, number: int, upload_id: str, chunk: bytes) -> dict[str, Any]:
        # RetryStore cannot replay a streamed write, so a part (idempotent: re-uploading a part
        # number replaces it) is retried here, a few times with backoff, on transient errors.
        conn = self._conn
        attempts = conn.config.part_attempts
        for attempt in range(1, attempts + 1):
            try:
                resp = conn.call(
                    f"upload part {number} of",
                    self._url,
                    lambda: self._client().upload_part(
                        Bucket=conn.bucket,
                        Key=self._full,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=chunk,
                    ),
                )
            except TransientStoreError as exc:
                if attempt == attempts:
                    raise
                delay = min(0.2 * 2**attempt, 5.0)
                _log.info(
                    "retrying (%d/%d) in %.2g s: part %d of %s: %s",
                    attempt,
                    attempts - 1,
                    delay,
                    number,
                    self._url,
                    " ".join(str(exc).split()),
                )
                time.sleep(delay)
                continue
            return {"PartNumber": number, "ETag": resp["ETag"]}
        raise AssertionError("unreachable")  # pragma: no cover

    def _commit(self) -> None:
        conn = self._conn
        if self._upload_id is None:
            body = bytes(self._buf)
            self._buf = bytearray()
            conn.call(
                "write",
                self._url,
                lambda: self._client().put_object(Bucket=conn.bucket, Key=self._full, Body=body),
            )
            return
        if self._buf:
            chunk = bytes(self._buf)
            self._buf = bytearray()
            self._submit(chunk)
        parts = [fut.result() for fut in self._parts]
        upload_id = self._upload_id
        conn.call(
            "complete the multipart upload of",
            self._url,
            lambda: self._client().complete_multipart_upload(
                Bucket=conn.bucket,
                Key=self._full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            ),
        )
        self._upload_id = None

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
