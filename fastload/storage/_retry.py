""":class:`RetryStore`: retry transient failures of any store with exponential backoff.

Which errors are retried:

* A :class:`~fastload.errors.StoreError` is retried exactly when its ``retryable`` attribute is
  true (:class:`~fastload.errors.TransientStoreError`: timeouts, throttling, server errors,
  dropped connections). Everything else, e.g. :class:`~fastload.errors.ObjectNotFoundError`,
  :class:`~fastload.errors.InvalidRangeError` or permission errors, is raised at once.
* A built-in :class:`ConnectionError` or :class:`TimeoutError` that is not a ``StoreError`` is
  retried too (:attr:`RetryConfig.retry_builtin_errors`): backends should translate their
  client library's errors, but a socket error that slips through is transient by nature. So are
  the transport errors of the HTTP client libraries when they slip through untranslated, matched
  by class name so that this module imports none of them (:data:`TRANSPORT_ERRORS`: a
  response cut inside its status line, headers or body, a stream that ended early, a read
  timeout, a connection closed mid-request).
  :class:`~fastload.errors.StoreUnavailableError` is a ``ConnectionError`` but is *not* retried:
  it means an inner :class:`RetryStore` already gave up.

A store that was never reached fails fast. Until one request of the store has been answered
(a success, or any error the server sent back), an error caused by a host name that does not
resolve gets at most :attr:`RetryConfig.dns_retries` retries (default 1), and one caused by a
connection that could not be made at all (refused, host or network unreachable, connect timeout)
at most :attr:`RetryConfig.connect_retries` (default 2): a wrong endpoint or a server that is not
running costs well under a second, not minutes of backoff. Once the store has answered, every
transient error gets the full budget, so a server restarting mid-epoch is ridden out. The cause
is found in the error's ``__cause__``/``__context__`` chain (:func:`unreachable_reason`), so a
backend only has to chain its errors (``raise ... from exc``). Whether the store has answered
is kept by the wrapper and travels with it when it is pickled (DataLoader workers of a dataset
that was opened get the full budget).

Backoff is exponential with "full jitter": before retry ``n`` (0-based) the wrapper sleeps a
uniformly random time in ``[0, min(max_backoff, initial_backoff * backoff_base ** n))``, which
spreads the retries of many workers that failed together. Each retry is logged at INFO on the
``fastload.storage`` logger as one line, ``retrying (3/10) in 2.1 s: <reason>`` (the ``fastload``
command prints these on stderr). When the retries or the time budget run out it raises
:class:`~fastload.errors.StoreUnavailableError` naming the URL, the number of attempts and how long
it tried, chained to the last error.

A stream resumed after a break checks that it still reads the object it began with, from what
the answers say, never from what they leave out: a reopened reader naming the version the read
began with continues; one naming another version is confirmed by a fresh ``head`` (the object
changed: :class:`~fastload.errors.StoreError`; the ``head`` names the first version: the answer
was not to be trusted, ask again); one naming no version, where the first one did, is compared
by the ``head``'s ETag and size (the same: continue; another ETag: changed; no ETag: ask again).
Missing information is never taken for a change.

:meth:`RetryStore.stats` counts, per process, the retries made, the streams resumed and the
operations given up.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from fastload._lazy import PerProcess
from fastload.errors import (
    InvalidArgumentError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from fastload.storage._base import DEFAULT_COALESCE_BYTES, DEFAULT_READ_CHUNK, ObjectWriter, Store
from fastload.storage._keys import ByteRange, ObjectMeta
from fastload.storage._retry_stream import ResumingReader
from fastload.storage._wrapper import WrapperStore

__all__ = ["TRANSPORT_ERRORS", "RetryConfig", "RetryStore", "is_retryable", "unreachable_reason"]

logger = logging.getLogger("fastload.storage")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """How :class:`RetryStore` retries. The defaults suit object stores (S3, Ceph RGW) under load.

    Attributes:
        max_retries: Retries after the first attempt, so at most ``max_retries + 1`` attempts.
            Default 10.
        initial_backoff: Upper bound of the first (random) sleep, in seconds. Default 0.1.
        max_backoff: Cap on the upper bound of any one sleep, in seconds. Default 15.
        backoff_base: Factor by which the upper bound grows per retry. Default 2.
        retry_timeout: Total time budget of one operation in seconds, counted from the start of
            its first attempt: no retry is started whose sleep would end after it. Default 180.
        retry_builtin_errors: Also retry built-in :class:`ConnectionError` and
            :class:`TimeoutError` that are not fastload errors. Default True.
        connect_retries: Retries (at most, and never more than ``max_retries``) of an operation
            that could not connect (refused, unreachable, connect timeout) while the store has
            never answered. Default 2.
        dns_retries: Retries (at most, and never more than ``max_retries``) of an operation whose
            host name did not resolve while the store has never answered. Default 1.
    """

    max_retries: int = 10
    initial_backoff: float = 0.1
    max_backoff: float = 15.0
    backoff_base: float = 2.0
    retry_timeout: float = 180.0
    retry_builtin_errors: bool = True
    connect_retries: int = 2
    dns_retries: int = 1

    def __post_init__(self) -> None:
        for name in ("max_retries", "connect_retries", "dns_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"RetryConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("initial_backoff", "max_backoff", "retry_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise InvalidArgumentError(
                    f"RetryConfig.{name} must be a number of seconds >= 0, got {value!r}"
                )
        if not isinstance(self.backoff_base, (int, float)) or self.backoff_base < 1:
            raise InvalidArgumentError(
                f"RetryConfig.backoff_base must be >= 1, got {self.backoff_base!r}"
            )

    def backoff_bound(self, retry: int) -> float:
        """Upper bound in seconds of the random sleep before retry number ``retry`` (0-based)."""
        # Cap the exponent so that many retries cannot overflow a float.
        growth = self.backoff_base ** min(retry, 64)
        return float(min(self.max_backoff, self.initial_backoff * growth))


#: Class names of the transport errors of ``http.client``, urllib3, requests and botocore that
#: are retried like a :class:`ConnectionError` when a backend lets one through untranslated:
#: a connection cut inside a response's status line, headers or body, a body shorter than its
#: announced length, a read that timed out, a connection closed mid-request.
TRANSPORT_ERRORS = frozenset(
    {
        # http.client
        "IncompleteRead",
        "BadStatusLine",
        "RemoteDisconnected",
        "LineTooLong",
        # urllib3
        "ProtocolError",
        "InvalidChunkLength",
        "ResponseNotChunked",
        # requests
        "ChunkedEncodingError",
        "ReadTimeout",
        # botocore
        "ResponseStreamingError",
        "IncompleteReadError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "HTTPClientError",
    }
)


def is_retryable(exc: BaseException, *, builtin_errors: bool = True) -> bool:
    """Whether :class:`RetryStore` retries ``exc`` (see the module documentation)."""
    if isinstance(exc, StoreError):
        return exc.retryable
    if not builtin_errors:
        return False
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(
        cls.__name__ in TRANSPORT_ERRORS for cls in type(exc).__mro__
    )


#: OS error numbers of a connection that could not be made at all.
_CONNECT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})
#: Class names of connect timeouts in HTTP client libraries (urllib3, botocore, requests), matched
#: by name so that this module imports none of them.
_CONNECT_TIMEOUTS = frozenset({"ConnectTimeoutError", "ConnectTimeout"})


def unreachable_reason(exc: BaseException) -> Literal["dns", "connect"] | None:
    """Why ``exc`` says that no connection to the server could be made, or ``None``.

    Looks through ``exc`` and the errors it was raised from (``__cause__``, ``__context__``):
    ``"dns"`` for a host name that did not resolve (:class:`socket.gaierror`), ``"connect"`` for a
    connection refused, a host or network unreachable, or a connect timeout. ``None`` for
    everything else, including errors after a connection was made (resets, read timeouts, 5xx).
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 32 and all(current is not e for e in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    # DNS first: urllib3's NameResolutionError is also a ConnectTimeoutError by inheritance.
    if any(isinstance(e, socket.gaierror) for e in chain):
        return "dns"
    for e in chain:
        if isinstance(e, ConnectionRefusedError) or (
            isinstance(e, OSError) and e.errno in _CONNECT_ERRNOS
        ):
            return "connect"
        if any(cls.__name__ in _CONNECT_TIMEOUTS for cls in type(e).__mro__):
            return "connect"
    return None


def _reason(exc: BaseException, limit: int = 300) -> str:
    """The fact of ``exc``'s message on one line, for the retry log: fastload messages state what
    failed, then after ``"; "`` what to do, which the final error repeats."""
    text = " ".join(str(exc).split()).split("; ", 1)[0] or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: The counters of :meth:`RetryStore.stats`.
COUNTER_NAMES = ("retries", "resumed_reads", "gave_up")


class _Counts:
    """One process's counts of a :class:`RetryStore` and the listeners told of each (made per
    process, never pickled)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys(COUNTER_NAMES, 0)
        self.listeners: list[Callable[[str], None]] = []

    def add(self, name: str) -> None:
        with self.lock:
            self.values[name] += 1
            listeners = list(self.listeners)
        for listener in listeners:
            listener(name)


def _jitter() -> float:
    # A module-level function (not random.random, a bound method) so that pickling a RetryStore
    # does not copy a random generator's state into every worker.
    return random.random()


class RetryStore(WrapperStore):
    """Retry the transient failures of ``store``; see the module documentation for the policy.

    What is retried, per operation:

    * ``get``, ``head``, ``put``, ``get_ranges`` and ``delete`` are retried whole (each is
      idempotent; ``put`` is atomic in every backend, so a retried put never shows a mix). A
      ``delete`` whose earlier attempt failed transiently and whose retry finds the key gone
      counts as done, since the earlier attempt may have deleted it.
    * ``list`` resumes after a failure: listings are in ascending key order, so a retried
      listing skips the keys already yielded. Retry count and time budget start again whenever
      a key arrives.
    * ``open_reader`` streams through the wrapped store's own reader; when the stream breaks
      with a transient error it is reopened at the current offset (retry count and time budget
      start again with each read call). Backends' readers do not resume by themselves, so a
      dropped connection is resumed here, once per break, under this one policy.
    * ``open_writer``: opening the writer is retried; ``write`` and ``commit`` are not, because
      the bytes already streamed cannot be replayed in general. A transient failure while
      writing raises out of the ``with`` block and leaves nothing visible (the writer aborts);
      write the object again, or use ``put`` (retried whole) for objects that fit in memory.

    Args:
        store: The store to wrap.
        config: Retry limits and backoff; see :class:`RetryConfig` for the defaults.
        sleep: Called with a number of seconds to wait between attempts (inject for tests).
        clock: Monotonic clock in seconds, for the time budget (inject for tests).
        jitter: Returns a uniform random float in ``[0, 1)`` that scales each sleep (for tests).

    The injected callables must be picklable if the store is pickled (module-level functions
    are). Besides its configuration the wrapper keeps one flag, whether the store has answered
    yet (see the module documentation); it is pickled with the wrapper. It is thread- and
    process-safe as far as the wrapped store is.
    """

    def __init__(
        self,
        store: Store,
        config: RetryConfig | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = _jitter,
    ) -> None:
        super().__init__(store)
        if config is not None and not isinstance(config, RetryConfig):
            raise InvalidArgumentError(
                f"RetryStore config must be a RetryConfig, got {type(config).__name__}"
            )
        self._config = config if config is not None else RetryConfig()
        self._sleep, self._clock, self._jitter = sleep, clock, jitter
        self._answered = False
        self._counts: PerProcess[_Counts] = PerProcess(_Counts)

    @property
    def config(self) -> RetryConfig:
        """The retry configuration."""
        return self._config

    @property
    def answered(self) -> bool:
        """Whether a request of this store has been answered (then every transient error gets
        the full retry budget; before, unreachable servers fail fast)."""
        return self._answered

    def stats(self) -> dict[str, int]:
        """This process's counts since the wrapper was made or unpickled here: ``retries``
        (attempts made after a transient failure, streams' included), ``resumed_reads``
        (broken streams reopened where they stopped) and ``gave_up`` (operations that ended in
        :class:`~fastload.errors.StoreUnavailableError`). A pickled copy, such as a DataLoader
        worker's, counts for itself from zero."""
        counts = self._counts.get()
        with counts.lock:
            return dict(counts.values)

    def add_count_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` in this process each time a counter of :meth:`stats` grows
        (``"retries"``, ``"resumed_reads"``, ``"gave_up"``), e.g. to sum them over the processes
        of a node. Listeners are this process's: they are not pickled with the wrapper, so a
        wrapper above registers its own in each process. A listener must be quick and not raise.
        """
        counts = self._counts.get()
        with counts.lock:
            counts.listeners.append(listener)

    # ---- the retry loop -----------------------------------------------------------------------

    def _note(self, exc: BaseException | None) -> None:
        """Record that the server answered: a success (``exc`` None) or an error it sent back.

        A backend's error (:class:`StoreError`) or a built-in :class:`ConnectionError` (a reset
        needs a connection) counts unless it says no connection was made; a bare
        :class:`TimeoutError` does not, since it may be a connect timeout.
        """
        if self._answered:
            return
        if exc is None or (
            isinstance(exc, StoreError | ConnectionError) and unreachable_reason(exc) is None
        ):
            self._answered = True

    def _wait_or_give_up(self, op: str, key: str, exc: Exception, retry: int, began: float) -> None:
        """Sleep before retry number ``retry`` (0-based), or raise StoreUnavailableError."""
        config = self._config
        self._note(exc)
        reason = None if self._answered else unreachable_reason(exc)
        limit = config.max_retries
        if reason == "dns":
            limit = min(limit, config.dns_retries)
        elif reason == "connect":
            limit = min(limit, config.connect_retries)
        elapsed = self._clock() - began
        delay = self._jitter() * config.backoff_bound(retry)
        where = self.child_url(key) if key else self.url
        if retry < limit and elapsed + delay <= config.retry_timeout:
            logger.info("retrying (%d/%d) in %.2g s: %s", retry + 1, limit, delay, _reason(exc))
            self._counts.get().add("retries")
            self._sleep(delay)
            return
        self._counts.get().add("gave_up")
        last = f"last error: {type(exc).__name__}: {exc}"
        if reason is not None:
            what = (
                "the server's host name does not resolve"
                if reason == "dns"
                else "no connection to the server could be made"
            )
            # fastload's own errors say what to check; a bare OSError does not.
            advice = (
                ""
                if isinstance(exc, StoreError)
                else ". Check the store's address and that its server is running"
            )
            raise StoreUnavailableError(
                f"{op} {where} failed: {what}; gave up after {retry + 1} attempts in "
                f"{elapsed:.1f} s, since the store has not answered any request yet. "
                f"{last}{advice}",
                url=where,
            ) from exc
        if retry >= limit:
            why = f"all {limit} retries used"
        else:
            why = f"another retry would exceed the {config.retry_timeout:g} s budget"
        raise StoreUnavailableError(
            f"{op} {where} failed {retry + 1} times over {elapsed:.1f} s ({why}); {last}. "
            "Check that the store is reachable and not overloaded, then run again (a "
            "conversion resumes where it stopped); to wait longer, open the store with "
            "retry=RetryConfig(max_retries=..., retry_timeout=...)",
            url=where,
        ) from exc

    def _retryable(self, exc: BaseException) -> bool:
        return is_retryable(exc, builtin_errors=self._config.retry_builtin_errors)

    def _count(self, name: str) -> None:
        self._counts.get().add(name)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` until it succeeds, fails for good, or the retries/time budget run out."""
        began = self._clock()
        retry = 0
        while True:
            try:
                result = fn()
            except Exception as exc:
                if not is_retryable(exc, builtin_errors=self._config.retry_builtin_errors):
                    self._note(exc)
                    raise
                self._wait_or_give_up(op, key, exc, retry, began)
                retry += 1
            else:
                self._answered = True
                return result

    # ---- operations ---------------------------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        return self._call("get", key, lambda: self._store.get(key, byte_range))

    def head(self, key: str) -> ObjectMeta:
        return self._call("head", key, lambda: self._store.head(key))

    def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = DEFAULT_COALESCE_BYTES
    ) -> builtins.list[bytes]:
        return self._call(
            "get_ranges", key, lambda: self._store.get_ranges(key, ranges, coalesce=coalesce)
        )

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._call("put", key, lambda: self._store.put(key, data))

    def abort_incomplete_writes(self, prefix: str = "") -> builtins.list[str]:
        # Idempotent: a retry after a lost reply finds the aborted uploads gone and returns the
        # rest, so its answer may lack keys aborted by the failed attempt.
        return self._call(
            "abort_incomplete_writes", prefix, lambda: self._store.abort_incomplete_writes(prefix)
        )

    def delete(self, key: str) -> None:
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self._store.delete(key)
            except ObjectNotFoundError:
                if attempts == 1:
                    raise
                # An earlier attempt failed transiently, possibly after deleting the key.

        self._call("delete", key, attempt)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        last: str | None = None
        retry = 0
        began = self._clock()
        while True:
            try:
                for meta in self._store.list(prefix):
                    self._answered = True
                    if last is not None and meta.key <= last:
                        continue  # already yielded before the failure
                    last = meta.key
                    retry = 0  # progress: the retry count and budget start again
                    yield meta
                    began = self._clock()
                self._answered = True
                return
            except Exception as exc:
                if not is_retryable(exc, builtin_errors=self._config.retry_builtin_errors):
                    self._note(exc)
                    raise
                self._wait_or_give_up("list", prefix, exc, retry, began)
                retry += 1

    def open_writer(self, key: str) -> ObjectWriter:
        return self._call("open_writer", key, lambda: self._store.open_writer(key))

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        """Stream through the wrapped store's own reader; a transient failure mid-stream reopens
        it and seeks back to where reading stopped, under the same retry budget."""
        raw = ResumingReader(self, key, chunk_size)
        return io.BufferedReader(raw, buffer_size=1 << 16)

    def __repr__(self) -> str:
        return f"RetryStore({self._store!r}, {self._config!r})"
