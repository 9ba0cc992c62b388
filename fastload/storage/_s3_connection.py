"""One bucket on one S3 endpoint: the per-process boto3 client and thread pool, the one place a
request's errors are translated (:meth:`S3Connection.call`), and :func:`ack_now`, which every
response body is passed through before it is read."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastload._lazy import PerProcess
from fastload.errors import ObjectNotFoundError, StoreError
from fastload.storage._s3_config import S3Config, env_endpoint, make_client
from fastload.storage._s3_errors import (
    ErrorContext,
    endpoint_name,
    is_transport_error,
    translate,
)

__all__ = ["S3Connection", "ack_now", "response_socket"]

T = TypeVar("T")

#: ``TCP_QUICKACK`` where the platform has it (Linux), else None.
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def ack_now(body: Any) -> None:
    """Acknowledge at once what the socket of a GET response ``body`` (botocore's
    ``StreamingBody``) has received, so that the server sends the rest without delay.

    Servers that write the headers and a short body in two writes with Nagle's algorithm on
    (Ceph RGW's beast frontend unless ``tcp_nodelay=1``) hold the body until the headers are
    acknowledged, and Linux delays that acknowledgement by 40 ms (the client just sent a
    request, so the connection looks interactive): every GET of a small object or range then
    takes 40 ms more. ``TCP_QUICKACK`` sends the pending acknowledgement now. Measured on the
    local RGW (benchmarks/bench_stream.py): a 9 KB GET 45 ms -> 2 ms, a 100 KB range 11 ms ->
    2.3 ms. A no-op where the platform lacks the option or the body exposes no socket
    (a future botocore, a stubbed client).
    """
    sock = response_socket(body)
    if _QUICKACK is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
    except OSError:  # closed meanwhile, or not TCP: nothing to acknowledge
        pass


def response_socket(body: Any) -> socket.socket | None:
    """The socket a botocore ``StreamingBody`` reads from (through urllib3), or None."""
    sock = getattr(getattr(getattr(body, "_raw_stream", None), "connection", None), "sock", None)
    return sock if isinstance(sock, socket.socket) else None


class S3Connection:
    """The requests of an :class:`~fastload.storage._s3.S3Store` to its bucket.

    The client and the pool are made on first use in each process (after ``fork`` too) and are
    shared by the threads of that process; boto3 clients are thread-safe. Pickling carries only
    the configuration.

    Args:
        url: The store's URL, for messages.
        bucket: The bucket name.
        config: The store's options.
    """

    def __init__(self, url: str, bucket: str, config: S3Config) -> None:
        self.url, self.bucket, self.config = url, bucket, config
        self._client: PerProcess[Any] = PerProcess(self._make_client)
        self._pool: PerProcess[ThreadPoolExecutor] = PerProcess(self._make_pool)
        self._bucket_checked = False

    def _make_client(self) -> Any:
        return make_client(self.config, self.url)

    def _make_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=self.config.parallel_get_threads, thread_name_prefix="fastload-s3"
        )

    def client(self) -> Any:
        """This process's boto3 client."""
        return self._client.get()

    def pool(self) -> ThreadPoolExecutor:
        """This process's threads for parallel gets and part uploads."""
        return self._pool.get()

    def close(self) -> None:
        """Drop this process's client and pool; they are made again on next use."""
        pool = self._pool.clear()
        if pool is not None:
            pool.shutdown(wait=False)
        client = self._client.clear()
        if client is not None:
            client.close()

    # ---- naming the endpoint --------------------------------------------------------------------

    def raw_endpoint(self) -> str | None:
        """The endpoint requests go to: the option, else what this process's client resolved
        (environment, config file, AWS), else the environment; ``None`` for AWS's default."""
        if self.config.endpoint_url:
            return self.config.endpoint_url
        client = self._client.peek()
        if client is not None:
            return str(client.meta.endpoint_url)
        return env_endpoint()

    def endpoint(self) -> str:
        """The endpoint requests go to, for messages, without any user:password part."""
        return endpoint_name(self.raw_endpoint())

    # ---- requests and their errors --------------------------------------------------------------

    def call(self, action: str, url: str, fn: Callable[[], T]) -> T:
        """``fn()``, with botocore's and the socket's errors translated (``action`` and ``url``
        name what failed)."""
        try:
            return fn()
        except Exception as exc:
            if not is_transport_error(exc):
                raise
            raise self.translate(exc, url, action) from exc

    def translate(self, exc: BaseException, url: str, action: str) -> StoreError:
        """The fastload error for ``exc``; see :mod:`fastload.storage._s3_errors`."""
        context = ErrorContext(
            self.bucket,
            self.raw_endpoint(),
            self.config.credential_sources(),
            self._explain_missing,
        )
        return translate(exc, url, action, context)

    def _explain_missing(self, err: ObjectNotFoundError) -> None:
        """HEAD answers a bare 404 for a missing bucket too: check the bucket (once)."""
        if self._bucket_checked:
            return
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client().head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                err.add_note(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint()}; create it or "
                    "fix the URL"
                )
            return
        except BotoCoreError:
            return
        self._bucket_checked = True
