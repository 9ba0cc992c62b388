"""Translation of botocore's exceptions into fastload errors that name the URL and the endpoint.

What a caller of the S3 store gets: :class:`~fastload.errors.ObjectNotFoundError` for a missing
key or bucket, :class:`~fastload.errors.InvalidRangeError`, :class:`~fastload.errors.StoreAuthError`
(credentials rejected or absent, naming where they were looked for),
:class:`~fastload.errors.StorePermissionError`, :class:`~fastload.errors.TransientStoreError` for
what a retry may cure (throttling, 5xx, timeouts, refused or dropped connections, servers that
cannot be reached, said as such), and :class:`~fastload.errors.StoreError` otherwise. Messages
never carry credentials: endpoints are shown without any ``user:password`` part.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
from collections.abc import Callable
from urllib.parse import urlsplit

from fastload.errors import (
    InvalidRangeError,
    ObjectNotFoundError,
    StoreAuthError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from fastload.storage._retry import unreachable_reason
from fastload.storage._s3_config import redact

__all__ = ["ErrorContext", "endpoint_name", "etag_of", "is_transport_error", "translate"]

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
class ErrorContext:
    """What a message needs to know about the store that failed.

    Attributes:
        bucket: The bucket name.
        raw_endpoint: The endpoint requests go to, as configured (may hold credentials, never
            shown as is), or ``None`` for AWS's default.
        credential_sources: Where credentials are looked for (never the credentials).
        explain_missing: Called with the error for a bare 404 (which HEAD answers for a missing
            bucket too), to add a note naming a missing bucket.
    """

    bucket: str
    raw_endpoint: str | None
    credential_sources: str
    explain_missing: Callable[[ObjectNotFoundError], None]

    @property
    def endpoint(self) -> str:
        """The endpoint, for messages."""
        return endpoint_name(self.raw_endpoint)

    @property
    def where(self) -> str:
        return f"at {self.endpoint}"


def endpoint_name(raw: str | None) -> str:
    """The endpoint ``raw`` for messages: without any user:password part, AWS said as such."""
    if not raw:
        return "AWS S3"
    endpoint = redact(raw)
    host = (urlsplit(endpoint).hostname or "").lower()
    if host == "amazonaws.com" or host.endswith(".amazonaws.com"):
        return f"AWS S3 ({endpoint})"
    return endpoint


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error of ``exc``'s ``__cause__``/``__context__`` chain."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def _parse_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (a ValueError, KeyError, ...) was raised while botocore parsed a response:
    the response was malformed, which for an S3 server means it was cut short on the way (the
    checks of :mod:`._s3_responses` catch the known cases before botocore's parser runs)."""
    if not isinstance(exc, ValueError | KeyError | TypeError | IndexError | AttributeError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if os.path.basename(filename) == "parsers.py" and "botocore" in filename:
            return True
        tb = tb.tb_next
    return False


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a boto3 call or a response body read, is the client's or the
    network's (to translate with :func:`translate`) rather than a fault in the calling code.

    That is: botocore's errors, socket errors (resets, timeouts), urllib3's and ``http.client``'s
    errors that escape botocore (``ProtocolError``, ``IncompleteRead``, ``BadStatusLine``), and an
    error raised inside botocore's response parser (a malformed response).
    """
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError as Urllib3Error

    return isinstance(
        exc, ClientError | BotoCoreError | OSError | Urllib3Error | http.client.HTTPException
    ) or _parse_failure(exc)


def translate(exc: BaseException, url: str, action: str, ctx: ErrorContext) -> StoreError:
    """Map a botocore (or socket) exception to a fastload error about ``url``.

    ``action`` is the verb of the message (``"read"``, ``"upload part 3 of"``). A
    :class:`StoreError` is returned unchanged.
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, ClientError):
        return _client_error(exc, url, action, ctx)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StoreAuthError(
            f"cannot {action} {url}: no usable credentials found; looked in "
            f"{ctx.credential_sources}",
            url=url,
        )
    from urllib3.exceptions import HTTPError as Urllib3Error

    if _parse_failure(exc):
        return TransientStoreError(
            f"cannot {action} {url} {ctx.where}: its answer could not be parsed "
            f"({type(exc).__name__}: {exc}), as when a response is cut short on the way; check "
            "that the endpoint is an S3 server and the network is sound (RetryStore retries this)",
            url=url,
        )
    if isinstance(exc, BotoCoreError | OSError | Urllib3Error | http.client.HTTPException):
        unreachable = _unreachable(exc, url, action, ctx)
        if unreachable is not None:
            return unreachable
        # Dropped connections, timeouts, broken response streams: worth retrying.
        # The botocore message names only the endpoint URL, never credentials.
        text = str(exc)
        if ctx.raw_endpoint:
            text = text.replace(ctx.raw_endpoint, redact(ctx.raw_endpoint))
        return TransientStoreError(
            f"cannot {action} {url} {ctx.where}: {type(exc).__name__}: {text}; check that "
            "the server is up and reachable (RetryStore retries this)",
            url=url,
        )
    return StoreError(f"cannot {action} {url}: {type(exc).__name__}", url=url)


def _client_error(exc: Exception, url: str, action: str, ctx: ErrorContext) -> StoreError:
    """The error for an answer of the server (a botocore ``ClientError``)."""
    response = getattr(exc, "response", {})
    err = response.get("Error", {})
    code = str(err.get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    # A HEAD request's error has no body: botocore gives the status as the code ("404").
    detail = f"HTTP {status}" if code in ("", str(status)) else f"HTTP {status} {code}"
    if code == "NoSuchBucket":
        return ObjectNotFoundError(
            f"cannot {action} {url}: bucket {ctx.bucket!r} does not exist {ctx.where} "
            f"({detail}); create it or fix the URL",
            url=url,
        )
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        missing = ObjectNotFoundError(f"no object {url} ({detail})", url=url)
        if code != "NoSuchKey":
            ctx.explain_missing(missing)
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
            f"cannot {action} {url}: the credentials were rejected {ctx.where} "
            f"({detail}); credentials are looked for in {ctx.credential_sources}",
            url=url,
        )
    if code == "AccessDenied" or status == 403:
        return StorePermissionError(
            f"cannot {action} {url}: access denied {ctx.where} ({detail}); check the "
            f"bucket policy or the credentials, which are looked for in "
            f"{ctx.credential_sources}",
            url=url,
        )
    if code in _TRANSIENT_CODES or status == 429 or status >= 500:
        return TransientStoreError(
            f"cannot {action} {url}: the server {ctx.where} answered {detail}; "
            "retry later (wrap the store in RetryStore to retry automatically)",
            url=url,
        )
    return StoreError(f"cannot {action} {url}: {detail} {ctx.where}", url=url)


def _unreachable(
    exc: BaseException, url: str, action: str, ctx: ErrorContext
) -> TransientStoreError | None:
    """The error for a server that could not be reached at all, or ``None``.

    Transient (a retry may cure it); :class:`~fastload.storage.RetryStore` still gives up
    quickly when the store never answered before.
    """
    reason = unreachable_reason(exc)
    if reason is None:
        return None
    endpoint = ctx.endpoint
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
        hint = f"for Ceph RGW or MinIO, give their endpoint ({where}); for AWS, check the network"
    elif reason == "dns":
        hint = f"check the host name of the endpoint ({where})"
    else:
        hint = f"check that the S3 server is running there and that the endpoint ({where}) is right"
    return TransientStoreError(f"cannot {action} {url}: {what}; {hint}", url=url)


def etag_of(raw: str | None) -> str | None:
    """An ETag header's value without its quotes, or ``None``."""
    return raw.strip('"') if raw else None
