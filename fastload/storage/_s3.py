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
  :class:`S3Store` itself does not retry.
  Errors that a retry may cure (throttling, 5xx, timeouts, refused or dropped connections) are raised as
  :class:`~fastload.errors.TransientStoreError`; 403/404 are not retryable.
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
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from fastload._plugins import require
from fastload.errors import (
    InvalidArgumentError,
    InvalidRangeError,
    ObjectNotFoundError,
    ReadOnlyStoreError,
    StoreAuthError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from fastload.storage._base import (
    ByteRange,
    ObjectMeta,
    ObjectWriter,
    Store,
    check_range,
    validate_key,
    validate_prefix,
)
from fastload.storage._retry import unreachable_reason

__all__ = ["S3Config", "S3Store"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

MiB = 1024 * 1024
#: S3's smallest allowed multipart part (except the last part).
MIN_PART_SIZE = 5 * MiB
#: S3's largest single PUT.
MAX_SINGLE_PUT = 5 * 1024 * MiB

_AUTH_CODES = frozenset(
    {
        "403",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidClientTokenId",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)


@dataclasses.dataclass(frozen=True)
class S3Config:
    """Options of an :class:`S3Store`; every field can also be passed to ``open_store`` by name.

    Attributes:
        endpoint_url: Server URL for S3-compatible services (``http://127.0.0.1:7480`` for the local
            Ceph RGW), ``http://`` or ``https://``. ``None`` means ``AWS_ENDPOINT_URL_S3`` or
            ``AWS_ENDPOINT_URL`` from the environment, or ``endpoint_url`` of the profile in
            ``~/.aws/config``, or else AWS.
        region: Signing region; ``None`` takes it from the standard chain (``AWS_DEFAULT_REGION``,
            config file), which for RGW and MinIO may be anything, e.g. ``us-east-1``.
        addressing_style: ``"path"``, ``"virtual"`` or ``"auto"``; ``None`` means ``"path"`` when
            an endpoint is set (option or environment) and ``"auto"`` otherwise.
        access_key_id: Access key; with ``secret_access_key`` it overrides the standard chain.
        secret_access_key: Secret key (never shown in ``repr``, messages or logs).
        session_token: Session token for temporary credentials (never shown).
        profile: A profile of the shared config/credentials files, instead of the default one.
        connect_timeout: Seconds to wait for a TCP connection.
        read_timeout: Seconds to wait for the next bytes of a response.
        max_pool_connections: HTTP connections kept per process; at least the number of threads
            using the store at once plus ``parallel_get_threads``, or requests queue for one.
        botocore_max_attempts: Attempts botocore makes itself, 1 = no botocore retries (retries
            belong to :class:`fastload.storage.RetryStore`).
        part_size: Multipart upload part size in bytes (at least 5 MiB, S3's minimum).
        multipart_threshold: ``put`` of at least this many bytes uploads parts in parallel.
        upload_concurrency: Parts of one writer uploaded at once (memory: this many parts).
        parallel_get_threshold: Whole-object (or range) gets larger than this use parallel GETs.
            Joining the parts costs one extra copy of the object, which on a CPU-bound loopback
            RGW made a 64 MiB get ~40% slower than one GET (benchmarks/bench_s3_clients.py); over
            a real network one TCP stream is the limit, so large objects gain. Default 128 MiB.
        parallel_get_part_size: Bytes per ranged GET of a parallel get (also the size of the
            first GET of every whole-object get, which learns the object size). Default 32 MiB.
        parallel_get_threads: Threads per process for parallel gets and uploads.
        list_page_size: Keys per ``ListObjectsV2`` request (1..1000).
        stream_resume_attempts: How often :meth:`S3Store.open_reader` re-requests the rest of an
            object after the stream broke, before it raises.
        part_attempts: Attempts per multipart part on transient errors (a streamed write cannot
            be retried as a whole by :class:`~fastload.storage.RetryStore`).
        read_only: Refuse ``put``, ``open_writer`` and ``delete``.
    """

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None
    access_key_id: str | None = dataclasses.field(default=None, repr=False)
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    profile: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_pool_connections: int = 64
    botocore_max_attempts: int = 1
    part_size: int = 8 * MiB
    multipart_threshold: int = 64 * MiB
    upload_concurrency: int = 4
    parallel_get_threshold: int = 128 * MiB
    parallel_get_part_size: int = 32 * MiB
    parallel_get_threads: int = 8
    list_page_size: int = 1000
    stream_resume_attempts: int = 3
    part_attempts: int = 3
    read_only: bool = False

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and not _valid_endpoint(self.endpoint_url):
            shown = (
                _redact(self.endpoint_url)
                if isinstance(self.endpoint_url, str)
                else repr(self.endpoint_url)
            )
            raise InvalidArgumentError(
                f"endpoint_url must be an http:// or https:// URL with a host, such as "
                f"http://127.0.0.1:7480, got {shown}"
            )
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise InvalidArgumentError(
                f"addressing_style must be 'path', 'virtual' or 'auto', got {self.addressing_style!r}"
            )
        if self.part_size < MIN_PART_SIZE:
            raise InvalidArgumentError(
                f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum part), "
                f"got {self.part_size}"
            )
        if not 1 <= self.list_page_size <= 1000:
            raise InvalidArgumentError(
                f"list_page_size must be in 1..1000, got {self.list_page_size}"
            )
        for name in (
            "max_pool_connections",
            "botocore_max_attempts",
            "upload_concurrency",
            "parallel_get_part_size",
            "parallel_get_threads",
            "part_attempts",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise InvalidArgumentError(
                "pass both access_key_id and secret_access_key, or neither (then the standard "
                "AWS credential chain is used)"
            )

    def credential_sources(self) -> str:
        """Where credentials are looked for, for messages (never the credentials themselves)."""
        if self.access_key_id is not None:
            return "the access_key_id/secret_access_key options given to the store"
        where = (
            f"profile {self.profile!r} of ~/.aws/credentials and ~/.aws/config"
            if self.profile
            else "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, AWS_PROFILE, "
            "~/.aws/credentials, ~/.aws/config, then container/instance metadata"
        )
        return f"the standard AWS chain ({where})"


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(S3Config))

#: The environment variables boto3 reads for the endpoint, in its order of precedence.
ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def _valid_endpoint(url: object) -> bool:
    if not isinstance(url, str):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


def _redact(url: str) -> str:
    """``url`` without any user:password part (endpoints may carry credentials)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return url


def _env_endpoint() -> str | None:
    """The endpoint boto3 takes from the environment, or ``None``."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    for name in ENDPOINT_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error of ``exc``'s ``__cause__``/``__context__`` chain."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def _etag(raw: str | None) -> str | None:
    return raw.strip('"') if raw else None


class _Proc:
    """Per-process resources: the boto3 client and a thread pool."""

    def __init__(self, client: Any, pool: ThreadPoolExecutor) -> None:
        self.pid = os.getpid()
        self.client = client
        self.pool = pool


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
        unknown = set(options) - _CONFIG_FIELDS
        if unknown:
            raise InvalidArgumentError(
                f"unknown s3 store option(s) {sorted(unknown)}; accepted: {sorted(_CONFIG_FIELDS)}"
            )
        if not bucket or "/" in bucket:
            raise InvalidArgumentError(f"invalid bucket name {bucket!r}; use s3://bucket/prefix")
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._key_prefix = self._prefix + "/" if self._prefix else ""
        self.config = dataclasses.replace(config or S3Config(), **options)
        self._lock = threading.Lock()
        self._proc: _Proc | None = None
        self._bucket_checked = False

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

    @property
    def supports_writes(self) -> bool:  # type: ignore[override]
        return not self.config.read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._bucket, self._prefix, self.config))

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self._endpoint()!r}" if self.config.endpoint_url else ""
        return f"S3Store({self.url!r}{endpoint})"

    def _raw_endpoint(self) -> str | None:
        """The endpoint requests go to: the option, else what this process's client resolved
        (environment, config file, AWS), else the environment; ``None`` for AWS's default."""
        if self.config.endpoint_url:
            return self.config.endpoint_url
        proc = self._proc
        if proc is not None and proc.pid == os.getpid():
            return str(proc.client.meta.endpoint_url)
        return _env_endpoint()

    def _endpoint(self) -> str:
        """The endpoint requests go to, for messages, without any user:password part."""
        raw = self._raw_endpoint()
        if not raw:
            return "AWS S3"
        endpoint = _redact(raw)
        host = (urlsplit(endpoint).hostname or "").lower()
        if host == "amazonaws.com" or host.endswith(".amazonaws.com"):
            return f"AWS S3 ({endpoint})"
        return endpoint

    def _resources(self) -> _Proc:
        proc = self._proc
        if proc is not None and proc.pid == os.getpid():
            return proc
        if proc is not None:  # forked: the parent's lock may have been held by another thread
            self._lock = threading.Lock()
        with self._lock:
            proc = self._proc
            if proc is None or proc.pid != os.getpid():
                proc = _Proc(self._make_client(), self._make_pool())
                self._proc = proc
        return proc

    def _make_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=self.config.parallel_get_threads, thread_name_prefix="fastload-s3"
        )

    def _make_client(self) -> Any:
        boto3 = require("boto3", extra="s3", feature="the s3:// store")
        from botocore.config import Config

        cfg = self.config
        style = cfg.addressing_style or ("path" if cfg.endpoint_url or _env_endpoint() else "auto")
        # A boto3 Session is not thread-safe: one per client, created under self._lock.
        session = boto3.session.Session(
            aws_access_key_id=cfg.access_key_id,
            aws_secret_access_key=cfg.secret_access_key,
            aws_session_token=cfg.session_token,
            profile_name=cfg.profile,
            region_name=cfg.region,
        )
        botocore_config = Config(
            s3={"addressing_style": style},
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            max_pool_connections=cfg.max_pool_connections,
            retries={"mode": "standard", "total_max_attempts": cfg.botocore_max_attempts},
            tcp_keepalive=True,
            # Flexible checksums (CRC32 trailers, aws-chunked bodies) are not understood by older
            # RGW and MinIO releases and cost CPU; integrity is checked by the dataset's checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            return session.client("s3", endpoint_url=cfg.endpoint_url, config=botocore_config)
        except ValueError as exc:  # botocore: "Invalid endpoint" from the environment or config
            env = [f"{n}={_redact(os.environ[n])}" for n in ENDPOINT_ENV_VARS if os.environ.get(n)]
            raise InvalidArgumentError(
                f"cannot open {self.url}: boto3 rejected the S3 endpoint configuration "
                f"({type(exc).__name__}); check "
                + (", ".join(env) if env else "endpoint_url in ~/.aws/config")
                + "; an endpoint looks like http://127.0.0.1:7480"
            ) from exc

    def _client(self) -> Any:
        return self._resources().client

    def close(self) -> None:
        """Drop this process's client and thread pool; they are recreated on next use."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.pid == os.getpid():
            proc.pool.shutdown(wait=False)
            proc.client.close()

    # ---- errors ---------------------------------------------------------------------------------

    def _full_key(self, key: str) -> str:
        return self._key_prefix + validate_key(key, url=self.url)

    def _where(self) -> str:
        return f"at {self._endpoint()}"

    def _translate(self, exc: BaseException, key: str | None, action: str) -> StoreError:
        """Map a botocore exception to a fastload error naming the URL; never include secrets."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        url = self.child_url(key) if key is not None else self.url
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            detail = f"HTTP {status} {code}".strip()
            if code == "NoSuchBucket":
                return ObjectNotFoundError(
                    f"cannot {action} {url}: bucket {self._bucket!r} does not exist {self._where()} "
                    f"({detail}); create it or fix the URL",
                    url=url,
                )
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                missing = ObjectNotFoundError(f"no object {url} ({detail})", url=url)
                if code != "NoSuchKey":
                    self._explain_missing(missing)
                return missing
            if code == "PreconditionFailed":  # we send If-Match only to pin multi-request reads
                return StoreError(
                    f"{url} changed while it was being read (its ETag changed between the "
                    f"requests of one read); read it again",
                    url=url,
                )
            if code in ("InvalidRange", "416") or status == 416:
                return InvalidRangeError(f"cannot {action} {url}: {detail}", url=url)
            if code in _AUTH_CODES:
                return StoreAuthError(
                    f"cannot {action} {url}: the credentials were rejected {self._where()} "
                    f"({detail}); credentials are looked for in {self.config.credential_sources()}",
                    url=url,
                )
            if code == "AccessDenied" or status == 403:
                return StorePermissionError(
                    f"cannot {action} {url}: access denied {self._where()} ({detail}); check the "
                    f"bucket policy or the credentials, which are looked for in "
                    f"{self.config.credential_sources()}",
                    url=url,
                )
            if code in _TRANSIENT_CODES or status in (429, 500, 502, 503, 504) or status >= 500:
                return TransientStoreError(
                    f"cannot {action} {url}: the server {self._where()} answered {detail}; "
                    "retry later (wrap the store in RetryStore to retry automatically)",
                    url=url,
                )
            return StoreError(f"cannot {action} {url}: {detail} {self._where()}", url=url)
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StoreAuthError(
                f"cannot {action} {url}: no usable credentials found; looked in "
                f"{self.config.credential_sources()}",
                url=url,
            )
        if isinstance(exc, BotoCoreError | OSError):
            unreachable = self._unreachable(exc, url, action)
            if unreachable is not None:
                return unreachable
            # Dropped connections, timeouts, broken response streams: worth retrying.
            # The botocore message names only the endpoint URL, never credentials.
            text = str(exc)
            raw = self._raw_endpoint()
            if raw:
                text = text.replace(raw, _redact(raw))
            return TransientStoreError(
                f"cannot {action} {url} {self._where()}: {type(exc).__name__}: {text}; check that "
                "the server is up and reachable (RetryStore retries this)",
                url=url,
            )
        return StoreError(f"cannot {action} {url}: {type(exc).__name__}", url=url)

    def _unreachable(self, exc: BaseException, url: str, action: str) -> TransientStoreError | None:
        """The error for a server that could not be reached at all, or ``None``.

        Transient (a retry may cure it); :class:`~fastload.storage.RetryStore` still gives up
        quickly when the store never answered before.
        """
        reason = unreachable_reason(exc)
        if reason is None:
            return None
        endpoint = self._endpoint()
        root = _root_cause(exc)
        detail = " ".join(str(root).split()) or type(root).__name__
        if reason == "dns":
            what = f"the host name of {endpoint} does not resolve ({detail})"
        elif isinstance(root, ConnectionRefusedError):
            what = f"connection refused by {endpoint}"
        else:
            what = f"cannot connect to {endpoint} ({detail})"
        where = "the endpoint_url option, --endpoint-url, or AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL"
        if endpoint.startswith("AWS S3"):
            hint = (
                f"for Ceph RGW or MinIO, give their endpoint ({where}); for AWS, check the network"
            )
        elif reason == "dns":
            hint = f"check the host name of the endpoint ({where})"
        else:
            hint = (
                f"check that the S3 server is running there and that the endpoint ({where}) "
                "is right"
            )
        return TransientStoreError(f"cannot {action} {url}: {what}; {hint}", url=url)

    def _call(self, action: str, key: str | None, fn: Callable[[], _T]) -> _T:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._translate(exc, key, action) from exc

    def _explain_missing(self, err: ObjectNotFoundError) -> None:
        """HEAD answers a bare 404 for a missing bucket too: check the bucket (once per store)."""
        if self._bucket_checked:
            return
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client().head_bucket(Bucket=self._bucket)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                err.add_note(
                    f"bucket {self._bucket!r} does not exist {self._where()}; create it or fix "
                    "the URL"
                )
            return
        except BotoCoreError:
            return
        self._bucket_checked = True

    def _check_writable(self, key: str) -> None:
        if self.config.read_only:
            raise ReadOnlyStoreError(
                f"store {self.url} was opened read-only; cannot write {key!r}",
                url=self.child_url(key),
            )

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
            _etag(resp.get("ETag")),
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
            data = resp["Body"].read()
            content_range = resp.get("ContentRange")
            total = int(content_range.rpartition("/")[2]) if content_range else len(data)
            return data, total, _etag(resp.get("ETag"))

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
        pool = self._resources().pool
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
        """Stream the object with one GET; a broken stream resumes with a ranged GET.

        The reader is seekable (a seek re-requests from the new offset) and pinned to the ETag seen
        when it opened: if the object is replaced meanwhile, reading raises :class:`StoreError`.
        ``chunk_size`` is the reader's buffer size (default 1 MiB). One thread per reader.

        Raises:
            ObjectNotFoundError: The key does not exist (raised here, not at the first read).
        """
        raw = _S3StreamReader(self, key, self._full_key(key))
        return io.BufferedReader(raw, buffer_size=chunk_size or MiB)

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
                    _etag(item.get("ETag")),
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

        Memory: up to ``upload_concurrency + 1`` parts of ``part_size`` bytes are held.
        """
        self._check_writable(key)
        return _S3Writer(self, key, self._full_key(key))

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


class _S3StreamReader(io.RawIOBase):
    """Sequential reads from one GET body, re-requested by range when the stream breaks or seeks."""

    def __init__(self, store: S3Store, key: str, full: str) -> None:
        super().__init__()
        self._store, self._key, self._full = store, key, full
        self._pos = 0
        self._etag: str | None = None
        self._body: Any = None
        self._size = 0
        self._open_at(0)

    def _open_at(self, pos: int) -> None:
        self._close_body()
        store = self._store
        kwargs: dict[str, Any] = {"Bucket": store.bucket, "Key": self._full}
        if pos:
            kwargs["Range"] = f"bytes={pos}-"
        if self._etag:
            kwargs["IfMatch"] = f'"{self._etag}"'
        resp = store._call("read", self._key, lambda: store._client().get_object(**kwargs))
        if self._etag is None:
            self._etag = _etag(resp.get("ETag"))
            self._size = int(resp["ContentLength"])
        self._body = resp["Body"]
        self._pos = pos

    def _close_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # pragma: no cover - closing a broken connection
                pass

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        pos = max(0, base + offset)
        if pos != self._pos:
            self._close_body()  # reopened lazily at the next read
            self._pos = pos
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        from botocore.exceptions import BotoCoreError

        out = memoryview(buffer).cast("B")
        if self._pos >= self._size or not out.nbytes:
            return 0
        attempts = self._store.config.stream_resume_attempts
        for attempt in range(attempts + 1):
            try:
                if self._body is None:
                    self._open_at(self._pos)
                chunk = self._body.read(min(out.nbytes, self._size - self._pos))
                if not chunk:
                    raise TransientStoreError(
                        f"stream of {self._store.child_url(self._key)} ended at byte "
                        f"{self._pos} of {self._size}",
                        url=self._store.child_url(self._key),
                    )
            except (BotoCoreError, OSError, TransientStoreError) as exc:
                self._close_body()
                if attempt == attempts:
                    raise self._store._translate(exc, self._key, "read") from exc
                delay = min(0.1 * 2**attempt, 2.0)
                _log.info(
                    "resuming (%d/%d) in %.2g s: the stream of %s broke at byte %d (%s)",
                    attempt + 1,
                    attempts,
                    delay,
                    self._store.child_url(self._key),
                    self._pos,
                    type(exc).__name__,
                )
                time.sleep(delay)
                continue
            n = len(chunk)
            out[:n] = chunk
            self._pos += n
            return n
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self._close_body()
        super().close()


class _S3Writer(ObjectWriter):
    """Multipart upload with bounded parallel part uploads; one PUT if it never fills a part."""

    def __init__(self, store: S3Store, key: str, full: str) -> None:
        super().__init__()
        self._store, self._key, self._full = store, key, full
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: builtins.list[Future[dict[str, Any]]] = []

    def _client(self) -> Any:
        return self._store._client()

    def _write(self, data: memoryview) -> None:
        part = self._store.config.part_size
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
        store = self._store
        if self._upload_id is None:
            resp = store._call(
                "start a multipart upload of",
                self._key,
                lambda: self._client().create_multipart_upload(Bucket=store.bucket, Key=self._full),
            )
            self._upload_id = str(resp["UploadId"])
        # Bound memory: wait for the oldest part when too many are in flight.
        pending = [f for f in self._parts if not f.done()]
        limit = store.config.upload_concurrency
        for fut in pending[: max(0, len(pending) - limit + 1)]:
            fut.result()
        for fut in self._parts:
            if fut.done():
                fut.result()  # surface a failed part now
        number = len(self._parts) + 1
        upload_id = self._upload_id
        self._parts.append(
            store._resources().pool.submit(self._upload_part, number, upload_id, chunk)
        )

    def _upload_part(self, number: int, upload_id: str, chunk: bytes) -> dict[str, Any]:
        # RetryStore cannot replay a streamed write, so a part (idempotent: re-uploading a part
        # number replaces it) is retried here, a few times with backoff, on transient errors.
        store = self._store
        attempts = store.config.part_attempts
        for attempt in range(1, attempts + 1):
            try:
                resp = store._call(
                    f"upload part {number} of",
                    self._key,
                    lambda: self._client().upload_part(
                        Bucket=store.bucket,
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
                    store.child_url(self._key),
                    " ".join(str(exc).split()),
                )
                time.sleep(delay)
                continue
            return {"PartNumber": number, "ETag": resp["ETag"]}
        raise AssertionError("unreachable")  # pragma: no cover

    def _commit(self) -> None:
        store = self._store
        if self._upload_id is None:
            body = bytes(self._buf)
            self._buf = bytearray()
            store._call(
                "write",
                self._key,
                lambda: self._client().put_object(Bucket=store.bucket, Key=self._full, Body=body),
            )
            return
        if self._buf:
            chunk = bytes(self._buf)
            self._buf = bytearray()
            self._submit(chunk)
        parts = [fut.result() for fut in self._parts]
        upload_id = self._upload_id
        store._call(
            "complete the multipart upload of",
            self._key,
            lambda: self._client().complete_multipart_upload(
                Bucket=store.bucket,
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
        store = self._store
        try:
            store._client().abort_multipart_upload(
                Bucket=store.bucket, Key=self._full, UploadId=upload_id
            )
        except Exception as exc:  # must not raise; say what is left behind
            _log.warning(
                "could not abort multipart upload of %s (%s); an S3 lifecycle rule for incomplete "
                "multipart uploads will clean it up",
                store.child_url(self._key),
                type(exc).__name__,
            )


def _rebuild(bucket: str, prefix: str, config: S3Config) -> S3Store:
    return S3Store(bucket, prefix, config)
