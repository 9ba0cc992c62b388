"""HDFS store: ``hdfs://namenode:port/path`` through the ``hdfs-native`` client.

Why ``hdfs-native``: it speaks HDFS's RPC and data-transfer protocols natively (Rust), so it needs no
JVM, no ``libhdfs`` and no Hadoop distribution on the training node — pyarrow's
``HadoopFileSystem`` needs all three. It supports name services (HA), ViewFS, Kerberos and
token authentication, and erasure-coded reads.

Atomicity: ``put`` and streamed writers write a temporary file beside the target
(``.fastload-tmp-…``) and rename it over the target when committed; a NameNode rename is atomic.

Retries: the client's own NameNode failover loop retries a refused connection for minutes by
default. This store lowers it (``dfs.client.failover.max.attempts``, option ``failover_attempts``)
and reports connection failures as retryable :class:`~fastload.errors.TransientStoreError`, so
:class:`~fastload.storage.RetryStore` applies one retry budget to every backend.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import os
import re
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import urlsplit

from fastload._lazy import PerProcess
from fastload._os import never_free
from fastload._plugins import require
from fastload.errors import (
    InvalidArgumentError,
    MissingDependencyError,
    ObjectNotFoundError,
    StoreAuthError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from fastload.storage._base import ByteRange, ObjectMeta, ObjectWriter, Store, check_range
from fastload.storage._keys import prefix_directory, validate_key, validate_prefix
from fastload.storage._local_temp import TMP_PREFIX

__all__ = ["HDFSStore"]

#: ``RPCError("org.apache...SomeException", "message\\n\\tat ...")`` as hdfs-native formats it.
_RPC_ERROR = re.compile(r'RPCError\(\s*"([\w.$]+)",\s*"(.*)', re.DOTALL)
#: DataNodes named in a DataTransferError: ``ip_addr: "127.0.0.1", ... xfer_port: 9866``.
_DATANODE = re.compile(r'ip_addr: \\?"([^"\\]+)\\?".*?xfer_port: (\d+)', re.DOTALL)
#: NameNode exceptions that mean "not now": a retry may succeed.
_RETRIABLE_RPC = frozenset(
    {
        "SafeModeException",
        "StandbyException",
        "RetriableException",
        "ObserverRetryOnActiveException",
        "NotReplicatedYetException",
    }
)


#: Every ``hdfs_native`` client this process made and still holds (weakly). Each client owns a
#: Tokio runtime whose threads exist only in the process that made it; dropping an inherited
#: client in a forked child (a DataLoader worker forgetting its parent's clients) waits forever
#: for those threads. So a forked child keeps every client it inherited alive until it exits.
_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()

#: ``hdfs-native`` keeps DataNode connections in one process-wide cache for 3 s after a read
#: (``DATANODE_CACHE_EXPIRY``). A forked child that took one of its parent's connections from that
#: cache would wait on a socket served by the parent's runtime, whose threads it does not have
#: (a read stalls until the socket times out). So a fork waits, at most :data:`_FORK_WAIT_LIMIT`
#: seconds, until no HDFS call is in flight and the last one ended more than the expiry ago; the
#: child then finds only expired entries and makes its own connections.
_DATANODE_CACHE_EXPIRY = 3.0
_FORK_WAIT_LIMIT = 15.0


class _Calls:
    """Counts the HDFS calls in flight in this process and when the last one ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.last_end = -math.inf
        self.used = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self.lock:
            self.in_flight += 1
            self.used = True
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1
                self.last_end = time.monotonic()

    def settle_before_fork(self) -> None:
        """Wait until a forked child cannot inherit a live DataNode connection (see above)."""
        if not self.used:
            return
        deadline = time.monotonic() + _FORK_WAIT_LIMIT
        while True:
            with self.lock:
                idle = self.in_flight == 0
                wait = self.last_end + _DATANODE_CACHE_EXPIRY + 0.25 - time.monotonic()
            if idle and wait <= 0:
                return
            if time.monotonic() >= deadline:
                warnings.warn(
                    "fastload: forking while HDFS reads are in flight; the child may wait on a "
                    "DataNode connection of its parent's. Give the DataLoader "
                    "multiprocessing_context='forkserver' to avoid forking an HDFS client.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
            time.sleep(min(max(wait, 0.01), 0.1) if idle else 0.01)

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.used = True  # the DataNode cache came along; a grandchild must wait as well
        for client in list(_CLIENTS):
            never_free(client)
        _CLIENTS.clear()


_CALLS = _Calls()
os.register_at_fork(before=_CALLS.settle_before_fork, after_in_child=_CALLS.after_fork_in_child)


def _first_line(message: str) -> str:
    """``message`` up to its first line break (real or escaped): a NameNode exception's text
    without the Java stack trace, at most 500 characters."""
    line = re.split(r"\n|\\n", message, maxsplit=1)[0].strip().rstrip('")').strip()
    return line[:500]


class _HDFSWriter(ObjectWriter):
    def __init__(self, store: HDFSStore, key: str) -> None:
        super().__init__()
        self._store, self._key = store, key
        self._path = store._path(key)
        parent = self._path.rsplit("/", 1)[0] or "/"
        self._tmp = f"{parent}/{TMP_PREFIX}{uuid.uuid4().hex}"
        self._file = store._create(self._tmp, key)

    def _write(self, data: memoryview) -> None:
        try:
            with _CALLS.running():
                self._file.write(bytes(data))
        except Exception as exc:
            raise self._store._translate(exc, self._key) from exc

    def _commit(self) -> None:
        client = self._store._client()
        try:
            with _CALLS.running():
                self._file.close()
                client.rename(self._tmp, self._path, overwrite=True)
        except Exception as exc:
            raise self._store._translate(exc, self._key) from exc

    def _abort(self) -> None:
        with _CALLS.running(), contextlib.suppress(Exception):
            self._file.close()
        with _CALLS.running(), contextlib.suppress(Exception):
            self._store._client().delete(self._tmp)


class HDFSStore(Store):
    """Objects as files under a directory of an HDFS cluster.

    Args:
        url: ``hdfs://namenode:port/path`` or ``hdfs://nameservice/path`` (HA, resolved through
            ``config`` or the Hadoop configuration in ``HADOOP_CONF_DIR``).
        config: Extra Hadoop configuration keys (``{"dfs.client.socket-timeout": "20000"}``).
        failover_attempts: NameNode connection attempts inside the client before an error is
            raised (retries beyond that belong to :class:`~fastload.storage.RetryStore`).
        read_only: Refuse writes.
        kerberos_principal, kerberos_keytab, kerberos_cache: Passed to the client.

    The client is created lazily in each process; the store pickles as its configuration.
    """

    def __init__(
        self,
        url: str,
        *,
        config: dict[str, str] | None = None,
        failover_attempts: int = 1,
        read_only: bool = False,
        kerberos_principal: str | None = None,
        kerberos_keytab: str | None = None,
        kerberos_cache: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "hdfs" or not parts.netloc:
            raise InvalidArgumentError(
                f"not an HDFS URL: {url!r}; use hdfs://namenode:port/path or hdfs://nameservice/path"
            )
        if parts.username or parts.password:
            raise InvalidArgumentError(
                "put HDFS users and credentials in options (kerberos_*) or the Hadoop "
                "configuration, not in the URL"
            )
        self._cluster = f"hdfs://{parts.netloc}"
        self._root = "/" + parts.path.strip("/") if parts.path.strip("/") else ""
        self._config = dict(config or {})
        self._config.setdefault(
            "dfs.client.failover.max.attempts", str(max(0, failover_attempts - 1))
        )
        self._config.setdefault("dfs.client.failover.sleep.base.millis", "100")
        self._config.setdefault("dfs.client.failover.sleep.max.millis", "2000")
        super().__init__(read_only=read_only)
        self._kerberos = {
            "kerberos_principal": kerberos_principal,
            "kerberos_keytab": kerberos_keytab,
            "kerberos_cache": kerberos_cache,
        }
        # One client per thread, as the original adapter chose; the thread-local itself is made
        # once per process (a forked child must not use its parent's connections).
        self._clients: PerProcess[threading.local] = PerProcess(threading.local)

    #: :func:`fastload.open_store` wraps HDFS stores in a :class:`~fastload.storage.RetryStore`
    #: unless told otherwise (``retry=False``).
    default_retry: ClassVar[bool] = True

    @classmethod
    def from_url(cls, url: str, **options: Any) -> HDFSStore:
        """Open ``hdfs://namenode:port/path`` as a bare store (retries are added by
        :func:`fastload.open_store`)."""
        return cls(url, **options)

    @property
    def url(self) -> str:
        return self._cluster + (self._root or "/")

    def child_url(self, key: str) -> str:
        return f"{self._cluster}{self._root}/{key}"

    # ---- helpers ----------------------------------------------------------------------------

    def _client(self) -> Any:
        """This thread's client, connected on first use (in each process and thread)."""
        local = self._clients.get()
        client = getattr(local, "client", None)
        if client is None:
            try:
                client = self._connect()
            except MissingDependencyError:
                raise  # says what to install; not a failure of the cluster
            except Exception as exc:
                raise self._translate(exc, "") from exc
            local.client = client
        return client

    def _connect(self) -> Any:
        """A new ``hdfs_native.Client`` for the cluster (the one place the library is called to
        make a client)."""
        hdfs_native = require("hdfs_native", extra="hdfs", feature="the hdfs:// store")
        kwargs = {k: v for k, v in self._kerberos.items() if v is not None}
        with _CALLS.running():
            client = hdfs_native.Client(self._cluster, config=self._config, **kwargs)
        _CLIENTS.add(client)
        return client

    def _create(self, path: str, key: str) -> Any:
        """Open a new file at ``path`` for writing ``key`` (replacing any file there, making the
        parent directories)."""
        client = self._client()
        hdfs_native = require("hdfs_native", extra="hdfs", feature="the hdfs:// store")
        try:
            with _CALLS.running():
                options = hdfs_native.WriteOptions(overwrite=True, create_parent=True)
                return client.create(path, options)
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def _path(self, key: str) -> str:
        validate_key(key, url=self.url)
        return f"{self._root}/{key}"

    def _translate(self, exc: BaseException, key: str) -> StoreError:
        where = self.child_url(key) if key else self.url
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, FileNotFoundError | NotADirectoryError):
            return ObjectNotFoundError(f"no object {where}", url=where)
        if isinstance(exc, IsADirectoryError):
            return ObjectNotFoundError(f"no object {where} (it is a directory)", url=where)
        if isinstance(exc, PermissionError):
            return self._denied(where, str(exc))
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
            return TransientStoreError(
                f"cannot reach the HDFS NameNode or DataNodes for {where}: {exc}; check that the "
                f"cluster {self._cluster} is up and reachable from this host",
                url=where,
            )
        if isinstance(exc, RuntimeError):  # hdfs-native's other errors: "Kind(details)"
            return self._translate_client_error(str(exc), where)
        return StoreError(f"HDFS error on {where}: {type(exc).__name__}: {exc}", url=where)

    def _denied(self, where: str, detail: str) -> StorePermissionError:
        return StorePermissionError(
            f"HDFS denied access to {where}: {detail}; check the path's owner, mode and ACLs, "
            "and the user (HADOOP_USER_NAME) or Kerberos principal fastload runs as",
            url=where,
        )

    def _translate_client_error(self, text: str, where: str) -> StoreError:
        """The error for one of ``hdfs-native``'s errors that reach Python as ``RuntimeError``
        with its Rust form as the message: ``RPCError("java.Class", "message")`` for an exception
        the NameNode raised, ``DataTransferError(...)`` when no DataNode holding a block answered,
        ``SASLError``/``GSSAPIError`` for authentication."""
        kind = text.split("(", 1)[0].strip()
        if kind == "RPCError":
            match = _RPC_ERROR.match(text)
            java_class, message = (match.group(1), match.group(2)) if match else ("", text)
            name = java_class.rsplit(".", 1)[-1]
            message = _first_line(message)
            if name == "AccessControlException":
                return self._denied(where, message)
            if name == "FileNotFoundException":
                return ObjectNotFoundError(f"no object {where}", url=where)
            if name in _RETRIABLE_RPC:
                return TransientStoreError(
                    f"the HDFS NameNode of {self._cluster} cannot serve {where} now ({name}: "
                    f"{message}); it is starting, in safe mode or not the active one, retry later",
                    url=where,
                )
            return StoreError(f"HDFS NameNode error on {where}: {name}: {message}", url=where)
        if kind in ("DataTransferError", "BlocksNotFound"):
            nodes = sorted(set(_DATANODE.findall(text)))
            held = f" (tried {', '.join(f'{ip}:{port}' for ip, port in nodes)})" if nodes else ""
            return TransientStoreError(
                f"no HDFS DataNode holding a block of {where} answered{held}; check that the "
                f"DataNodes of {self._cluster} are up and reachable from this host",
                url=where,
            )
        if kind in ("SASLError", "GSSAPIError", "NoSASLMechanism"):
            return StoreAuthError(
                f"HDFS authentication failed for {where}: {_first_line(text)}; for Kerberos, "
                "check the ticket cache (klist) or pass kerberos_principal and kerberos_keytab",
                url=where,
            )
        return StoreError(f"HDFS error on {where}: {_first_line(text)}", url=where)

    # ---- Store API --------------------------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        path = self._path(key)
        client = self._client()
        try:
            with _CALLS.running():
                reader = client.read(path)
                size = len(reader)
                if byte_range is None:
                    data: bytes = reader.read_range(0, size) if size else b""
                    return data
                check_range(byte_range, size, url=self.child_url(key))
                if byte_range.length == 0:
                    return b""
                data = reader.read_range(byte_range.start, byte_range.length)
                return data
        except StoreError:
            raise
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def head(self, key: str) -> ObjectMeta:
        path = self._path(key)
        client = self._client()
        try:
            with _CALLS.running():
                status = client.get_file_info(path)
        except Exception as exc:
            raise self._translate(exc, key) from exc
        if status.isdir:
            where = self.child_url(key)
            raise ObjectNotFoundError(f"no object {where} (it is a directory)", url=where)
        mtime_ms = int(status.modification_time)
        return ObjectMeta(
            key, int(status.length), mtime_ms / 1000.0, f"{mtime_ms:x}-{status.length:x}"
        )

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        validate_prefix(prefix, url=self.url)
        head = prefix_directory(prefix)
        if head is None:
            return
        start = f"{self._root}/{head}" if head else (self._root or "/")
        client = self._client()
        try:
            with _CALLS.running():
                statuses = builtins.list(client.list_status(start, recursive=True))
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._translate(exc, prefix) from exc
        base = (self._root or "") + "/"
        items = []
        for status in statuses:
            if status.isdir:
                continue
            path = str(status.path)
            if not path.startswith("/"):  # some client versions report paths relative to start
                path = f"{start.rstrip('/')}/{path}"
            key = path[len(base) :] if path.startswith(base) else path.lstrip("/")
            if key.rsplit("/", 1)[-1].startswith(TMP_PREFIX) or not key.startswith(prefix):
                continue
            mtime_ms = int(status.modification_time)
            items.append(
                ObjectMeta(
                    key, int(status.length), mtime_ms / 1000.0, f"{mtime_ms:x}-{status.length:x}"
                )
            )
        items.sort(key=lambda m: m.key)
        yield from items

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._put_through_writer(key, data)  # the writer checks that the store is writable

    def open_writer(self, key: str) -> ObjectWriter:
        self._check_writable(key)
        return _HDFSWriter(self, key)

    def delete(self, key: str) -> None:
        self._check_writable(key)
        path = self._path(key)
        client = self._client()
        try:
            with _CALLS.running():
                deleted = client.delete(path, False)
        except Exception as exc:
            raise self._translate(exc, key) from exc
        if not deleted:
            where = self.child_url(key)
            raise ObjectNotFoundError(f"no object {where}", url=where)
