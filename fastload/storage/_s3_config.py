"""Options of the S3 store, the endpoint they resolve to, and the boto3 client made from them."""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from typing import Any
from urllib.parse import urlsplit

from fastload._plugins import require
from fastload.errors import InvalidArgumentError
from fastload.storage._s3_responses import register as register_response_check

__all__ = [
    "CONFIG_FIELDS",
    "ENDPOINT_ENV_VARS",
    "MAX_SINGLE_PUT",
    "MIN_PART_SIZE",
    "MiB",
    "S3Config",
    "env_endpoint",
    "make_client",
    "redact",
]

MiB = 1024 * 1024
#: S3's smallest allowed multipart part (except the last part).
MIN_PART_SIZE = 5 * MiB
#: S3's largest single PUT.
MAX_SINGLE_PUT = 5 * 1024 * MiB


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
        stream_resume_attempts: Deprecated and ignored: a broken stream is resumed by
            :class:`~fastload.storage.RetryStore` (which :func:`fastload.open_store` adds for
            ``s3://``), the one retry layer; tune it with ``retry=RetryConfig(...)``. Setting
            it warns.
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
    stream_resume_attempts: int | None = None
    part_attempts: int = 3
    read_only: bool = False

    def __post_init__(self) -> None:
        if self.stream_resume_attempts is not None:
            warnings.warn(
                "S3Config.stream_resume_attempts is ignored: broken S3 streams are resumed by "
                "RetryStore (added by open_store for s3:// URLs); pass "
                "retry=RetryConfig(max_retries=...) to change how often",
                DeprecationWarning,
                stacklevel=3,
            )
        if self.endpoint_url is not None and not _valid_endpoint(self.endpoint_url):
            shown = (
                redact(self.endpoint_url)
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


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(S3Config))

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


def redact(url: str) -> str:
    """``url`` without any user:password part (endpoints may carry credentials)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return url


def env_endpoint() -> str | None:
    """The endpoint boto3 takes from the environment, or ``None``."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    for name in ENDPOINT_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


#: botocore's data loader (the parsed endpoint table and S3 model), shared by the clients of a
#: process and inherited by its forked children, by data path.
_LOADERS: dict[Any, Any] = {}
_LOADERS_LOCK = threading.Lock()


def _share_data_loader(session: Any) -> None:
    """Give the botocore ``session`` the process's data loader for its data path.

    A fresh session parses botocore's JSON files (the endpoint table, the S3 model) again: about
    0.13 CPU-s and, on a loaded machine, 0.3 s before the first request of every DataLoader
    worker. The loader holds parsed data and file paths only (no sockets, no locks), so a forked
    worker reusing its parent's is safe, and makes its client in about 0.015 CPU-s.
    """
    path = session.get_config_variable("data_path")
    with _LOADERS_LOCK:
        loader = _LOADERS.get(path)
        if loader is None:
            _LOADERS[path] = session.get_component("data_loader")
        else:
            session.register_component("data_loader", loader)


def make_client(config: S3Config, url: str) -> Any:
    """A new boto3 S3 client for ``config`` (``url``, the store's, names it in errors)."""
    require("boto3", extra="s3", feature="the s3:// store")
    import botocore.session
    from botocore.config import Config
    from botocore.exceptions import ProfileNotFound

    cfg = config
    style = cfg.addressing_style or ("path" if cfg.endpoint_url or env_endpoint() else "auto")
    # A botocore session is not thread-safe: one per client (clients are made once per
    # process). A boto3 Session adds nothing a client needs, and would append boto3's data
    # directory to the shared loader's search path on every client.
    session = botocore.session.Session(profile=cfg.profile)
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
        _share_data_loader(session)
        client = session.create_client(
            "s3",
            region_name=cfg.region,
            endpoint_url=cfg.endpoint_url,
            aws_access_key_id=cfg.access_key_id,
            aws_secret_access_key=cfg.secret_access_key,
            aws_session_token=cfg.session_token,
            config=botocore_config,
        )
    except ProfileNotFound as exc:
        profile = cfg.profile or os.environ.get("AWS_PROFILE")
        raise InvalidArgumentError(
            f"cannot open {url}: profile {profile!r} is in neither the config nor the "
            "credentials file (~/.aws/config, ~/.aws/credentials, or AWS_CONFIG_FILE and "
            "AWS_SHARED_CREDENTIALS_FILE); fix the profile option or AWS_PROFILE"
        ) from exc
    except ValueError as exc:  # botocore: "Invalid endpoint" from the environment or config
        env = [f"{n}={redact(os.environ[n])}" for n in ENDPOINT_ENV_VARS if os.environ.get(n)]
        raise InvalidArgumentError(
            f"cannot open {url}: boto3 rejected the S3 endpoint configuration "
            f"({type(exc).__name__}); check "
            + (", ".join(env) if env else "endpoint_url in ~/.aws/config")
            + "; an endpoint looks like http://127.0.0.1:7480"
        ) from exc
    # A response whose connection was cut inside its headers is an error, not a short answer.
    register_response_check(client)
    return client
