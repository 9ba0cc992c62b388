"""A TCP proxy that damages HTTP responses on purpose, by seed: :class:`FaultProxy`.

Put it between a client and an HTTP server (the local Ceph RGW in fastload's tests) to see what
the client does when the network misbehaves the way shared cluster networks and load balancers
do: connections cut inside a response's headers or body, connections reset, responses stalled
past the client's read timeout or delayed within it, responses trickled in small pieces.

How it works: every client connection gets its own connection to the server. Requests are passed
through as they come (their heads are read to learn each request's method, so that a response to
a ``HEAD`` is known to have no body). Each response of the server is read whole (status line,
headers and body, framed by ``Content-Length``, chunked encoding or the end of the stream), then
either passed on or damaged, as the :class:`FaultPlan` decides.

Which responses are damaged, and how, is a pure function of the plan's seed, the connection's
number (in the order connections were accepted) and the response's number on that connection:
never of timing. A single-threaded client therefore meets the same faults in every run; clients
with several connections at once meet the same set of faults per connection. ``script`` names
faults by the response's number over the whole proxy instead, for tests that need one exact
fault.

The kinds of :data:`FAULT_KINDS`:

``cut_headers``  the response's first bytes, cut at a seeded point inside its status line or
                 headers, then the connection is closed.
``cut_body``     the headers and part of the body, then closed (a response without a body is cut
                 in its headers instead).
``reset``        the bytes before a seeded point, then a TCP reset (``SO_LINGER`` 0).
``stall``        the bytes before a seeded point, then nothing for ``stall_s`` seconds (longer
                 than the client's read timeout), then the connection is closed.
``delay``        nothing for ``delay_s`` seconds (within the read timeout), then the response.
``trickle``      the whole response in pieces of ``trickle_bytes`` with ``trickle_gap_s`` between.

Only the first four break a request; ``delay`` and ``trickle`` slow it.

Example::

    with FaultProxy("http://127.0.0.1:7480", FaultPlan(seed=1, fraction=0.05)) as proxy:
        store = fastload.open_store("s3://bucket/ds", endpoint_url=proxy.endpoint_url,
                                    read_timeout=1.0)
        ...
        print(proxy.stats())   # connections, responses, faults by kind
"""

from __future__ import annotations

import collections
import dataclasses
import random
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["BREAKING_KINDS", "FAULT_KINDS", "FaultPlan", "FaultProxy"]

#: Every kind of fault (see the module documentation).
FAULT_KINDS = ("cut_headers", "cut_body", "reset", "stall", "delay", "trickle")
#: The kinds after which the client gets no whole response.
BREAKING_KINDS = ("cut_headers", "cut_body", "reset", "stall")

_MAX_HEAD = 64 * 1024


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Which responses a :class:`FaultProxy` damages, and how.

    Attributes:
        seed: Seeds every decision (with the connection's and the response's numbers).
        fraction: Share of responses damaged, 0..1.
        kinds: The kinds drawn from, equally likely (see :data:`FAULT_KINDS`).
        stall_s: How long a ``stall`` holds the response before closing; make it longer than
            the client's read timeout.
        delay_s: How long a ``delay`` holds the response before sending it whole; make it
            shorter than the read timeout.
        trickle_bytes: Bytes per piece of a ``trickle``.
        trickle_gap_s: Pause between the pieces of a ``trickle``.
        script: Response number over the whole proxy (0-based, in the order responses begin)
            → kind, applied before ``fraction``: an exact fault for a test with one client
            thread.
    """

    seed: int = 0
    fraction: float = 0.0
    kinds: tuple[str, ...] = BREAKING_KINDS
    stall_s: float = 2.0
    delay_s: float = 0.2
    trickle_bytes: int = 4096
    trickle_gap_s: float = 0.001
    script: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"FaultPlan.fraction must be in 0..1, got {self.fraction!r}")
        unknown = [k for k in (*self.kinds, *self.script.values()) if k not in FAULT_KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"unknown fault kind(s) {unknown}; choose from {FAULT_KINDS}")

    def decide(self, connection: int, response: int, overall: int) -> tuple[str | None, float]:
        """The fault for a response (``None``: pass it on) and a point in ``[0, 1)`` that places
        it; a function of the seed and the three numbers only."""
        rng = random.Random(f"{self.seed}:{connection}:{response}")
        draw, kind, point = rng.random(), rng.choice(self.kinds), rng.random()
        if overall in self.script:
            return self.script[overall], point
        return (kind if draw < self.fraction else None), point


class FaultProxy:
    """A threaded TCP proxy on ``127.0.0.1`` that damages HTTP responses per a :class:`FaultPlan`.

    Args:
        upstream: The server's URL (``http://host:port``) or a ``(host, port)`` pair.
        plan: The faults; :meth:`set_plan` changes it while running (new decisions use it).

    Use as a context manager, or call :meth:`start` and :meth:`close`. Thread-safe.
    """

    def __init__(self, upstream: str | tuple[str, int], plan: FaultPlan | None = None) -> None:
        if isinstance(upstream, str):
            parts = urlsplit(upstream)
            if not parts.hostname or not parts.port:
                raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
            upstream = (parts.hostname, parts.port)
        self.upstream = upstream
        self._plan = plan or FaultPlan()
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._connections = 0
        self._responses = 0
        self._closing = threading.Event()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    # ---- life -----------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen on a free port of 127.0.0.1 and serve in background threads."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        thread = threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closing.set()
        if self._listener is not None:
            _shutdown(self._listener, socket.SHUT_RDWR)  # wakes the accepting thread
            _close(self._listener)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock, socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        if self._listener is None:
            raise RuntimeError("FaultProxy is not started")
        return int(self._listener.getsockname()[1])

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``: give it to the client instead of the server's URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def plan(self) -> FaultPlan:
        """The plan new decisions use."""
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Use ``plan`` from the next response on."""
        self._plan = plan

    def stats(self) -> dict[str, int]:
        """``connections`` accepted, ``responses`` begun, ``faults`` (breaking or not) and one
        count per kind met (``cut_headers``, ...)."""
        with self._lock:
            out = {"connections": self._connections, "responses": self._responses}
            out["faults"] = sum(self._counts.values())
            out.update({kind: self._counts[kind] for kind in FAULT_KINDS})
        return out

    # ---- serving --------------------------------------------------------------------------------

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                number = self._connections
                self._connections += 1
            thread = threading.Thread(
                target=self._serve, args=(client, number), name=f"faultproxy-{number}", daemon=True
            )
            thread.start()
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve(self, client: socket.socket, number: int) -> None:
        self._track(client)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _close(client)
            return
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(upstream)
        methods: collections.deque[str] = collections.deque()
        ready = threading.Condition()
        requests = threading.Thread(
            target=self._pass_requests,
            args=(client, upstream, methods, ready),
            name=f"faultproxy-{number}-requests",
            daemon=True,
        )
        requests.start()
        reset = False
        try:
            reset = self._pass_responses(client, upstream, number, methods, ready)
        except OSError:
            pass
        finally:
            # shutdown() acts at once: close() alone waits for the request thread's file object
            # to let go of the socket. A reset (SO_LINGER 0, set already) must reach the client
            # as an RST, so its reading half only is shut here and the close sends the RST.
            _shutdown(client, socket.SHUT_RD if reset else socket.SHUT_RDWR)
            _shutdown(upstream, socket.SHUT_RDWR)
            with ready:
                ready.notify_all()
            requests.join(timeout=5)
            _close(client)
            _close(upstream)
            with self._lock:
                self._sockets.discard(client)
                self._sockets.discard(upstream)

    def _pass_requests(
        self,
        client: socket.socket,
        upstream: socket.socket,
        methods: collections.deque[str],
        ready: threading.Condition,
    ) -> None:
        """Copy requests from the client to the server, noting each one's method."""
        source = client.makefile("rb")
        try:
            while True:
                head = _read_head(source)
                if head is None:
                    break
                method = head.split(b" ", 1)[0].decode("latin-1").upper()
                with ready:
                    methods.append(method)
                    ready.notify_all()
                upstream.sendall(head)
                body = _read_body(source, _headers(head), is_request=True)
                if body:
                    upstream.sendall(body)
        except (OSError, ValueError):
            pass
        finally:
            source.close()
            _shutdown(upstream, socket.SHUT_WR)
            with ready:
                methods.append("")  # no more requests
                ready.notify_all()

    def _pass_responses(
        self,
        client: socket.socket,
        upstream: socket.socket,
        number: int,
        methods: collections.deque[str],
        ready: threading.Condition,
    ) -> bool:
        """Copy responses from the server to the client, damaging those the plan says; True
        when the connection is to end with a reset."""
        source = upstream.makefile("rb")
        try:
            return self._responses_from(source, client, number, methods, ready)
        finally:
            source.close()

    def _responses_from(
        self,
        source: Any,
        client: socket.socket,
        number: int,
        methods: collections.deque[str],
        ready: threading.Condition,
    ) -> bool:
        on_connection = 0
        while not self._closing.is_set():
            with ready:
                while not methods and not self._closing.is_set():
                    ready.wait(0.5)
                if not methods or methods[0] == "":
                    return False
                method = methods[0]
            head = _read_head(source)
            if head is None:
                return False
            status = _status(head)
            if 100 <= status < 200:  # interim (100 Continue): passed on, the final one follows
                client.sendall(head)
                continue
            with ready:
                methods.popleft()
            no_body = method == "HEAD" or status in (204, 304)
            body = b"" if no_body else _read_body(source, _headers(head), is_request=False)
            with self._lock:
                overall = self._responses
                self._responses += 1
            kind, point = self._plan.decide(number, on_connection, overall)
            on_connection += 1
            if kind is None:
                client.sendall(head + body)
                continue
            with self._lock:
                self._counts[kind] += 1
            ended = self._fault(client, kind, point, head, body)
            if ended is not None:
                return ended
        return False

    def _fault(
        self, client: socket.socket, kind: str, point: float, head: bytes, body: bytes
    ) -> bool | None:
        """Send ``head + body`` damaged by ``kind``; None when the connection goes on, else
        whether it ends with a reset."""
        plan = self._plan
        whole = head + body
        if kind == "delay":
            self._closing.wait(plan.delay_s)
            client.sendall(whole)
            return None
        if kind == "trickle":
            step = max(1, plan.trickle_bytes)
            for at in range(0, len(whole), step):
                client.sendall(whole[at : at + step])
                if self._closing.wait(plan.trickle_gap_s):
                    return False
            return None
        if kind == "cut_body" and not body:
            kind = "cut_headers"
        if kind == "cut_headers":
            cut = 1 + int(point * (len(head) - 2))  # at least one byte, never the blank line
        elif kind == "cut_body":
            cut = len(head) + int(point * len(body))  # never the whole body
        else:  # reset, stall: anywhere before the end
            cut = int(point * len(whole))
        if cut:
            client.sendall(whole[:cut])
        if kind == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return True
        if kind == "stall":
            self._closing.wait(plan.stall_s)
        return False


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:  # not connected (any more)
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:  # pragma: no cover
        pass


def _read_head(source: Any) -> bytes | None:
    """A request's or response's start line and headers through the blank line, or None at the
    end of the stream."""
    lines: list[bytes] = []
    size = 0
    while True:
        line = source.readline(_MAX_HEAD + 1)
        if not line:
            return None
        lines.append(line)
        size += len(line)
        if size > _MAX_HEAD:
            raise ValueError("HTTP head too long")
        if line in (b"\r\n", b"\n") and len(lines) > 1:
            return b"".join(lines)


def _headers(head: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    return out


def _status(head: bytes) -> int:
    parts = head.split(b" ", 2)
    try:
        return int(parts[1])
    except (IndexError, ValueError):
        return 0


def _read_body(source: Any, headers: Mapping[str, str], *, is_request: bool) -> bytes:
    """The body after a head, with its framing bytes (chunk sizes and all)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        while True:
            line = source.readline(1024)
            if not line:
                raise ValueError("chunked body cut short")
            parts.append(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers through the blank line
                    trailer = source.readline(_MAX_HEAD)
                    parts.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(parts)
            parts.append(_read_exactly(source, size + 2))
    if "content-length" in headers:
        return _read_exactly(source, int(headers["content-length"]))
    if is_request:
        return b""
    return bytes(source.read())  # framed by the end of the stream


def _read_exactly(source: Any, n: int) -> bytes:
    data = source.read(n)
    if len(data) != n:
        raise ValueError(f"stream ended {n - len(data)} bytes short")
    return bytes(data)
