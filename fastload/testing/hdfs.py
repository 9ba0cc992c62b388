"""Start or reuse a real local HDFS (``tools/hdfs-up.sh``: Hadoop's MiniDFSCluster) from tests and
benchmarks, and inject its faults.

:func:`acquire` returns the :class:`HDFSCluster` running from ``$HDFS_RUN`` (default
``/tmp/fastload-hdfs``): it reuses a cluster that already answers, starts one otherwise, and
:func:`release` stops it only if a fastload test session started it and no other live process
still uses it (users are counted with files under ``$HDFS_RUN/users``, guarded by a lock file),
so parallel test runs on one machine share one cluster, as with :mod:`fastload.testing.ceph`. A
cluster started by hand with ``tools/hdfs-up.sh`` is never stopped here.

:func:`private_cluster` starts a cluster of its own in a new run directory, for tests that stop
DataNodes or restart the NameNode (the shared cluster's other users must not see those faults).

Needs Java (17) and Maven; the first start downloads Hadoop's jars into ``~/.m2`` (see
``tools/hdfs-up.sh``). The pytest fixtures :func:`hdfs_cluster` and :func:`hdfs_url` are for test
modules to import; under ``CI=true`` a cluster that cannot start fails the test instead of
skipping it (:func:`fastload.testing.need`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastload.errors import FastloadError
from fastload.testing import need

# The run directory's lock and live-user files, and the scripts, work as for the Ceph cluster.
from fastload.testing._clusters import join, leave, locked, run_tool_script, tools_dir

__all__ = [
    "INSTALL_HINT",
    "ConnectionCutter",
    "HDFSCluster",
    "HDFSStartError",
    "acquire",
    "hdfs_cluster",
    "hdfs_missing",
    "hdfs_url",
    "private_cluster",
    "release",
    "run_dir",
    "scratch_url",
    "tools_dir",
]

#: What to run when the cluster cannot be started.
INSTALL_HINT = (
    "apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven "
    "(Maven Central must be reachable for the first start), then tools/hdfs-up.sh"
)
_PROGRAMS = ("java", "javac", "mvn")


class HDFSStartError(FastloadError, RuntimeError):
    """The local HDFS could not be started or controlled; the message has the script's output."""


@dataclasses.dataclass(frozen=True)
class HDFSCluster:
    """A running local HDFS.

    Attributes:
        url: ``hdfs://127.0.0.1:PORT`` of the NameNode.
        run_dir: The cluster's ``$HDFS_RUN`` directory (data, logs, pid, control port).
        datanodes: Number of DataNodes.
        started: True if this process started the cluster.
    """

    url: str
    run_dir: str
    datanodes: int
    started: bool = False

    def control(self, command: str, timeout: float = 180.0) -> str:
        """Send one control command to the launcher and return its reply after ``ok``.

        Commands: ``status``, ``stop-datanode I``, ``start-datanode I``, ``stop-namenode``,
        ``start-namenode``, ``restart-namenode [SECONDS]`` (see ``tools/hdfs/MiniHDFS.java``).
        Each returns once done (a started NameNode is out of safe mode).

        Raises:
            HDFSStartError: The launcher does not answer or answered with an error.
        """
        port = int((Path(self.run_dir) / "control.port").read_text())
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
                sock.sendall(command.encode() + b"\n")
                reply = sock.makefile("r", encoding="utf-8").readline().strip()
        except OSError as exc:
            raise HDFSStartError(
                f"the HDFS launcher of {self.run_dir} does not answer on its control port "
                f"{port}: {exc}; see {self.run_dir}/log/minihdfs.log"
            ) from exc
        if not reply.startswith("ok"):
            raise HDFSStartError(f"{command!r} failed: {reply or 'no reply'}")
        return reply[2:].strip()

    def stop_datanode(self, index: int) -> None:
        """Stop DataNode ``index`` (0-based); its blocks stay listed at the NameNode, so clients
        must fail over to the other replicas."""
        self.control(f"stop-datanode {index}")

    def start_datanode(self, index: int) -> None:
        """Start a stopped DataNode again on its old ports."""
        self.control(f"start-datanode {index}")

    def restart_namenode(self, down_seconds: float = 0.0) -> None:
        """Stop the NameNode, keep it down ``down_seconds``, start it again (same port) and wait
        until it is out of safe mode."""
        self.control(f"restart-namenode {down_seconds}")

    def status(self) -> str:
        """The launcher's one-line status (``namenode=up datanodes=0:up,1:down ...``)."""
        return self.control("status", timeout=10.0)

    def datanode_ports(self) -> list[int]:
        """The data-transfer ports of the DataNodes (clients read and write blocks there), from
        the run directory's ``datanodes`` file."""
        lines = (Path(self.run_dir) / "datanodes").read_text().split("\n")
        return [int(line.rsplit(":", 1)[1]) for line in lines if line.strip()]


class ConnectionCutter:
    """Cuts TCP connections to the given local ports, as a flaky network does: every ``every``
    seconds, one port drawn with ``seed``, its established connections are destroyed by the
    kernel (``ss -K``: both ends see a reset or an abort, mid-request or mid-transfer).

    Real faults on real connections, with no proxy between the client and the server (HDFS
    clients connect to the DataNode addresses the NameNode hands out, which a proxy cannot
    stand in for). Needs ``ss`` (iproute2) and ``CAP_NET_ADMIN`` (root) and a kernel with
    ``CONFIG_INET_DIAG_DESTROY``; :meth:`check` says whether this machine has them.
    Use as a context manager; :attr:`cut` counts the connections destroyed.
    """

    def __init__(self, ports: list[int], every: float = 0.2, seed: int = 0) -> None:
        self.ports, self.every = ports, every
        self.cut = 0
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastload-cutter", daemon=True)

    @staticmethod
    def check() -> str | None:
        """Why connections cannot be cut here, or None when they can (a loopback connection of
        its own is cut as a test)."""
        if shutil.which("ss") is None:
            return "`ss` (iproute2) is not installed"
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)) as client:
                peer, _ = server.accept()
                with peer:
                    if _kill_connections(port) < 1:
                        return (
                            "`ss -K` destroyed no socket (it needs CAP_NET_ADMIN and a kernel "
                            "with CONFIG_INET_DIAG_DESTROY)"
                        )
                    client.settimeout(2)
                    try:
                        data = client.recv(1)
                    except OSError:
                        return None
                    return None if data == b"" else "a cut connection still delivered data"

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.cut += _kill_connections(self._random.choice(self.ports))

    def __enter__(self) -> ConnectionCutter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _kill_connections(port: int) -> int:
    """Destroy the established TCP connections to 127.0.0.1:``port``; how many were."""
    proc = subprocess.run(
        ["ss", "-K", "-t", "-n", "state", "established", "dst", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return sum(1 for line in proc.stdout.splitlines()[1:] if line.strip())


def run_dir() -> Path:
    """The shared cluster's directory: ``$HDFS_RUN`` or ``/tmp/fastload-hdfs``."""
    return Path(os.environ.get("HDFS_RUN", "/tmp/fastload-hdfs"))


def hdfs_missing() -> list[str]:
    """The programs the scripts need that are not on ``PATH`` (empty when all are there)."""
    return [p for p in _PROGRAMS if shutil.which(p) is None]


def _cluster(run: Path, started: bool) -> HDFSCluster:
    url = (run / "url").read_text().strip()
    datanodes = len((run / "datanodes").read_text().splitlines())
    return HDFSCluster(url=url, run_dir=str(run), datanodes=datanodes, started=started)


def _running(run: Path) -> HDFSCluster | None:
    if not (run / "url").is_file():
        return None
    try:
        cluster = _cluster(run, started=False)
        cluster.status()
    except (OSError, ValueError, HDFSStartError):
        return None
    return cluster


def _run_script(name: str, run: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = run_tool_script(
        name,
        run,
        run_var="HDFS_RUN",
        timeout=timeout,
        error=HDFSStartError,
        hint=INSTALL_HINT,
        env=env,
    )
    return proc.stdout


def _start(run: Path, timeout: float, env: dict[str, str] | None = None) -> HDFSCluster:
    missing = hdfs_missing()
    if missing:
        raise HDFSStartError(f"{', '.join(missing)} not found on PATH; {INSTALL_HINT}")
    _run_script("hdfs-up.sh", run, timeout, env)
    return _cluster(run, started=True)


# Fixtures of several test modules share one acquisition per process.
_mutex = threading.Lock()
_held: dict[str, tuple[HDFSCluster, int]] = {}


def acquire(start_timeout: float = 300.0) -> HDFSCluster:
    """Reuse the running shared cluster or start one, and count this process as a user.

    Raises:
        HDFSStartError: Java or Maven is missing or ``hdfs-up.sh`` failed (message has its output).
    """
    run = run_dir()
    with _mutex:
        if str(run) in _held:
            cluster, count = _held[str(run)]
            _held[str(run)] = (cluster, count + 1)
            return cluster
        run.parent.mkdir(parents=True, exist_ok=True)
        with locked(run):
            found = _running(run)
            if found is None:
                found = _start(run, start_timeout)
            join(run, started=found.started)
        _held[str(run)] = (found, 1)
        return found


def release(cluster: HDFSCluster, stop_timeout: float = 120.0) -> None:
    """Stop counting this use; stop the cluster if a test session started it and it is unused."""
    run = Path(cluster.run_dir)
    with _mutex:
        _, count = _held.pop(str(run), (cluster, 1))
        if count > 1:
            _held[str(run)] = (cluster, count - 1)
            return
        leave(run, lambda: _run_script("hdfs-down.sh", run, stop_timeout))


@contextlib.contextmanager
def private_cluster(
    datanodes: int = 2, block_size: int = 1024 * 1024, start_timeout: float = 300.0
) -> Iterator[HDFSCluster]:
    """A cluster of this caller's own, in a new run directory, stopped and removed on exit.

    For fault tests (stopped DataNodes, a restarted NameNode) that other users of the shared
    cluster must not see. Starting one takes ~6 s once the jars are in ``~/.m2``.

    Args:
        datanodes: Number of DataNodes (replication is 2).
        block_size: HDFS block size in bytes, a multiple of 512 (small: files span blocks).

    Raises:
        HDFSStartError: The cluster could not be started.
    """
    run = Path(tempfile.gettempdir()) / f"fastload-hdfs-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        env = {"HDFS_DATANODES": str(datanodes), "HDFS_BLOCK_SIZE": str(block_size)}
        cluster = _start(run, start_timeout, env)
        yield cluster
    finally:
        if run.exists():
            _run_script("hdfs-down.sh", run, 120.0)


def scratch_url(cluster: HDFSCluster, name: str = "") -> str:
    """A fresh directory URL on ``cluster`` (``/fastload-tests/<name>-<random>``) for one test."""
    return f"{cluster.url}/fastload-tests/{name or 'scratch'}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def hdfs_cluster() -> Iterator[HDFSCluster]:
    """The shared local HDFS (started or reused); skips without Java/Maven, fails under CI=true."""
    try:
        cluster = acquire()
    except HDFSStartError as exc:
        need("HDFS (MiniDFSCluster)", False, str(exc))  # the message says how to fix it
        raise  # unreachable: need() skips or fails
    try:
        yield cluster
    finally:
        release(cluster)


@pytest.fixture(scope="session")
def hdfs_url(hdfs_cluster: HDFSCluster) -> str:
    """``hdfs://127.0.0.1:PORT`` of the shared local HDFS."""
    return hdfs_cluster.url
