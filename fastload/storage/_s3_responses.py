"""The check that an S3 response arrived whole before botocore parses it: :func:`check_response`.

A connection cut inside a response's header block does not make Python's HTTP client fail:
``http.client`` ends the header block at the end of the stream as it would at the blank line, so
botocore is handed a response with the headers that arrived, the last one possibly cut inside its
value. Left alone that gives an untyped ``ValueError`` (``int('')`` for a ``Content-Length:``
cut after the colon), a response without the ETag that pins a resumed read (then taken for a
changed object), or, for a response that lost its ``Content-Length``, an empty body read to the
end of the stream as if it were the whole object. A response cut inside its *body* is caught by
the body's framing (urllib3 and botocore raise when fewer bytes than announced arrive).

:func:`check_response` runs on botocore's ``before-parse`` event of every S3 response with a
2xx status (an error status is judged by its status code, which arrived whole) and raises
:class:`ResponseCutError` (a :class:`ConnectionError`, which the S3 store translates into a
:class:`~fastload.errors.TransientStoreError`, so :class:`~fastload.storage.RetryStore` asks
again) when the response shows it was cut:

* a response that should have a body (not to a HEAD, not 204/304) names neither its length
  (``Content-Length``) nor ``Transfer-Encoding: chunked``: nothing says where its body ends;
* a header botocore parses as a number or a time is not one (``Content-Length: 10`` cut to
  ``Content-Length: ``, a date cut short);
* an ETag that opens its quote and does not close it (``"5494ab`` of ``"5494ab…"``): quoted ETags
  (what S3, Ceph RGW and MinIO send) show their own end;
* a GetObject or HeadObject answer without ``Content-Length`` or ``ETag`` (both always sent by
  S3 servers), or a GetObject ``Content-Range`` that is not ``bytes FIRST-LAST/SIZE``.

What no check can see: a value cut inside its digits on a response without a body (a HEAD whose
``Content-Length: 1048576`` arrives as ``Content-Length: 104``) when no header the check requires
follows it. Ceph RGW sends ``Content-Length`` first and ``ETag`` after it, so a complete ETag
proves the size complete there; on a server that sends the size last, a HEAD cut exactly inside
it is not detected. A GET cut anywhere in its headers is always detected: no body byte follows a
cut, so its body is short of any announced length.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ResponseCutError", "check_response", "register"]

_DIGITS = re.compile(r"\s*-?\d+\s*")
_CONTENT_RANGE = re.compile(r"\s*bytes\s+\d+-\d+/(\d+|\*)\s*")
#: An HTTP date as servers send it (IMF-fixdate): a cut one may still parse as another time.
_HTTP_DATE = re.compile(r"\s*[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT\s*")
#: Operations whose success always carries these headers on every S3 server.
_REQUIRED = {
    "GetObject": ("content-length", "etag"),
    "HeadObject": ("content-length", "etag"),
}


class ResponseCutError(ConnectionError):
    """An S3 response arrived incomplete (its connection was cut inside the headers): what was
    missing or cut is in the message. Transient: the same request sent again may succeed."""


def register(client: Any) -> None:
    """Run :func:`check_response` on every response of the boto3 S3 ``client``."""
    client.meta.events.register("before-parse.s3", check_response)


def check_response(response_dict: dict[str, Any], operation_model: Any, **_kwargs: Any) -> None:
    """Raise :class:`ResponseCutError` when a 2xx response shows it was cut (see the module
    documentation); a botocore ``before-parse`` handler."""
    status = int(response_dict.get("status_code") or 0)
    if not 200 <= status < 300:
        return
    problem = _problem(response_dict["headers"], operation_model, status)
    if problem is None:
        return
    body = response_dict.get("body")
    close = getattr(body, "close", None)
    if close is not None:  # a streamed body holds the broken connection: drop it, do not pool it
        try:
            close()
        except Exception:  # pragma: no cover - closing a broken connection
            pass
    raise ResponseCutError(
        f"the {status} response to {operation_model.name} arrived incomplete ({problem}): its "
        "connection was cut inside the headers"
    )


def _problem(headers: Any, operation_model: Any, status: int) -> str | None:
    """What shows the response was cut, or None."""
    method = str(operation_model.http.get("method", "")).upper()
    name = operation_model.name
    if (
        method != "HEAD"
        and status not in (204, 304)
        and headers.get("content-length") is None
        and "chunked" not in str(headers.get("transfer-encoding", "")).lower()
    ):
        return "no Content-Length and no chunked encoding: nothing says where its body ends"
    for header in _REQUIRED.get(name, ()):
        if headers.get(header) is None:
            return f"no {header} header"
    etag = headers.get("etag")
    if etag is not None and etag.startswith('"') and (len(etag) < 2 or not etag.endswith('"')):
        return f"ETag {etag!r} has no closing quote"
    if name == "GetObject":
        content_range = headers.get("content-range")
        if content_range is not None and not _CONTENT_RANGE.fullmatch(content_range):
            return f"Content-Range {content_range!r} is not 'bytes FIRST-LAST/SIZE'"
    return _bad_typed_header(headers, operation_model)


def _bad_typed_header(headers: Any, operation_model: Any) -> str | None:
    """A header botocore would parse as an integer or a time that is not one, or None."""
    shape = operation_model.output_shape
    if shape is None:
        return None
    from botocore.utils import parse_timestamp

    for member in shape.members.values():
        if member.serialization.get("location") != "header":
            continue
        header = member.serialization.get("name")
        value = headers.get(header) if header else None
        if value is None:
            continue
        if member.type_name in ("integer", "long"):
            if not _DIGITS.fullmatch(value):
                return f"{header} {value!r} is not a number"
        elif member.type_name == "timestamp" and header.lower() != "expires":
            # botocore keeps an unparsable Expires as ExpiresString; other times must be whole.
            if value[:1].isalpha() and "," in value[:5]:
                if not _HTTP_DATE.fullmatch(value):
                    return f"{header} {value!r} is not a whole HTTP date"
                continue
            try:
                parse_timestamp(value)
            except Exception:
                return f"{header} {value!r} is not a time"
    return None
