"""The S3 store's streamed reader: one GET body read sequentially, pinned to one ETag."""

from __future__ import annotations

from typing import Any

from fastload.errors import StoreError, TransientStoreError
from fastload.storage._base import SeekableReader
from fastload.storage._s3_connection import S3Connection, ack_now
from fastload.storage._s3_errors import etag_of, is_transport_error

__all__ = ["READ_PIECE", "S3StreamReader"]

#: Most bytes taken from the response body per read (a read of more returns fewer; readers and
#: buffers above ask again).
READ_PIECE = 1024 * 1024


class S3StreamReader(SeekableReader):
    """Sequential reads of one object from one GET body; a seek re-requests from the new offset.

    The first GET is sent when the reader is made (so a missing key raises there) and its ETag
    pins every later request (``If-Match``): an object replaced meanwhile raises
    :class:`~fastload.errors.StoreError` instead of mixing versions. A stream that breaks raises
    :class:`~fastload.errors.TransientStoreError` and is not resumed here:
    :class:`~fastload.storage.RetryStore` (which :func:`fastload.open_store` adds for ``s3://``)
    is the one layer that retries, and it resumes at the offset reached.

    It reads the object ``full`` (its key in the bucket) through ``conn``, the store's
    connection; ``url`` names it in messages.
    """

    def __init__(self, conn: S3Connection, url: str, full: str) -> None:
        super().__init__()
        self._conn, self._url, self._full = conn, url, full
        self._etag: str | None = None
        self._body: Any = None
        self._object_size = 0
        self._open_at(0)

    def _open_at(self, pos: int) -> None:
        """Send the GET of the object from byte ``pos`` on; its body is read next."""
        self._close_body()
        kwargs: dict[str, Any] = {"Bucket": self._conn.bucket, "Key": self._full}
        if pos:
            kwargs["Range"] = f"bytes={pos}-"
        if self._etag:
            kwargs["IfMatch"] = f'"{self._etag}"'
        client = self._conn.client()
        resp = self._conn.call("read", self._url, lambda: client.get_object(**kwargs))
        if self._etag is None:
            self._etag = etag_of(resp.get("ETag"))
            self._object_size = int(resp["ContentLength"])
        self._body = resp["Body"]
        ack_now(self._body)

    def _close_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # pragma: no cover - closing a broken connection
                pass

    def _size(self) -> int:
        return self._object_size

    @property
    def version(self) -> str | None:
        return self._etag

    @property
    def object_size(self) -> int:
        """The object's size in bytes, as the first GET's answer gave it."""
        return self._object_size

    def _moved(self) -> None:
        self._close_body()  # reopened at the new position by the next read

    def _read_into(self, out: memoryview) -> int:
        if self._pos >= self._object_size:
            return 0
        try:
            if self._body is None:
                self._open_at(self._pos)
            # At most READ_PIECE bytes per read: urllib3 returns each read as a new bytes
            # object, and pieces this small reuse freed memory instead of mapping new pages.
            want = min(out.nbytes, self._object_size - self._pos, READ_PIECE)
            chunk = self._body.read(want)
            if not chunk:
                raise TransientStoreError(
                    f"stream of {self._url} ended at byte {self._pos} of {self._object_size}",
                    url=self._url,
                )
        except Exception as exc:
            self._close_body()
            if isinstance(exc, StoreError) or not is_transport_error(exc):
                raise
            raise self._conn.translate(exc, self._url, "read") from exc
        n = len(chunk)
        out[:n] = chunk
        return n

    def close(self) -> None:
        self._close_body()
        super().close()
