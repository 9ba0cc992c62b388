"""Start or reuse the local single-node Ceph cluster (``tools/ceph-up.sh``) from tests and benchmarks.

:func:`ceph_cluster` is a context manager yielding the S3 endpoint and credentials of the cluster
in ``$CEPH_RUN`` (default ``/tmp/fastload-ceph``). It reuses a cluster that already answers, starts
one otherwise, and on exit stops the cluster only if a fastload test session started it and no other
live process still uses it (users are counted with files under ``$CEPH_RUN/users``, guarded by a lock
file), so parallel test runs on one machine share one cluster safely. A cluster started by hand with
``tools/ceph-up.sh`` is never stopped here.

Needs the Debian packages ``ceph-mon ceph-osd radosgw ceph-common``; :func:`ceph_missing` says which
programs are absent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastload.errors import FastloadError
from fastload.testing._clusters import join, leave, live_users, locked, run_tool_script, tools_dir

__all__ = [
    "INSTALL_HINT",
    "CephS3",
    "CephStartError",
    "acquire",
    "ceph_cluster",
    "ceph_missing",
    "is_sole_user",
    "release",
    "run_dir",
    "start_rgw",
    "stop_rgw",
    "tools_dir",
]

#: What to run when the cluster cannot be started.
INSTALL_HINT = (
    "apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common, "
    "then tools/ceph-up.sh"
)
_PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool")


class CephStartError(FastloadError, RuntimeError):
    """The local Ceph cluster could not be started; the message has the script's output."""


@dataclasses.dataclass(frozen=True)
class CephS3:
    """The S3 side of a running local cluster.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT`` of radosgw (use path-style addressing).
        access_key_id: The S3 user's access key.
        secret_access_key: The S3 user's secret key (hidden from ``repr``).
        region: Any region works with RGW; this one is what ``s3.env`` exports.
        run_dir: The cluster's ``$CEPH_RUN`` directory (config, logs, pids).
        started: True if this process started the cluster.
    """

    endpoint_url: str
    access_key_id: str
    secret_access_key: str = dataclasses.field(repr=False)
    region: str = "us-east-1"
    run_dir: str = ""
    started: bool = False

    def store_options(self) -> dict[str, Any]:
        """Keyword options for ``open_store("s3://bucket/prefix", **options)``."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this cluster (path-style); ``config`` goes to botocore's Config."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            config=Config(s3={"addressing_style": "path"}, **config),
        )


def run_dir() -> Path:
    """The cluster directory: ``$CEPH_RUN`` or ``/tmp/fastload-ceph``."""
    return Path(os.environ.get("CEPH_RUN", "/tmp/fastload-ceph"))


def ceph_missing() -> list[str]:
    """The Ceph programs the scripts need that are not on ``PATH`` (empty when all are there)."""
    return [p for p in _PROGRAMS if shutil.which(p) is None]


def _answers(endpoint_url: str, timeout: float = 2.0) -> bool:
    parts = urlsplit(endpoint_url)
    conn = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout
    )
    try:
        conn.request("GET", "/")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _parse_env(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export ") and "=" in line:
            name, _, value = line[len("export ") :].partition("=")
            env[name.strip()] = value.strip()
    return env


def _cluster_from_env(env: dict[str, str], run: Path, started: bool) -> CephS3:
    try:
        return CephS3(
            # AWS_ENDPOINT_URL since the script exports what boto3 reads; S3_ENDPOINT_URL before
            endpoint_url=env.get("AWS_ENDPOINT_URL") or env["S3_ENDPOINT_URL"],
            access_key_id=env["AWS_ACCESS_KEY_ID"],
            secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region=env.get("AWS_DEFAULT_REGION", "us-east-1"),
            run_dir=str(run),
            started=started,
        )
    except KeyError as exc:
        raise CephStartError(f"{run}/s3.env lacks {exc.args[0]}; run tools/ceph-down.sh") from None


def _running(run: Path) -> CephS3 | None:
    env_file = run / "s3.env"
    if not env_file.is_file():
        return None
    cluster = _cluster_from_env(_parse_env(env_file.read_text()), run, started=False)
    return cluster if _answers(cluster.endpoint_url) else None


def _run_script(name: str, run: Path, timeout: float) -> str:
    proc = run_tool_script(
        name, run, run_var="CEPH_RUN", timeout=timeout, error=CephStartError, hint=INSTALL_HINT
    )
    return proc.stdout


def acquire(start_timeout: float = 180.0) -> CephS3:
    """Reuse the running cluster or start one, and count this process as a user.

    Raises:
        CephStartError: The programs are missing or ``ceph-up.sh`` failed (message has its output).
    """
    run = run_dir()
    run.parent.mkdir(parents=True, exist_ok=True)
    with locked(run):
        cluster = _running(run)
        if cluster is None:
            missing = ceph_missing()
            if missing:
                raise CephStartError(f"{', '.join(missing)} not found on PATH; {INSTALL_HINT}")
            out = _run_script("ceph-up.sh", run, start_timeout)
            cluster = _cluster_from_env(_parse_env(out), run, started=True)
        join(run, started=cluster.started)
        return cluster


def release(cluster: CephS3, stop_timeout: float = 120.0) -> None:
    """Stop counting this process; stop the cluster if a test session started it and it is unused."""
    run = Path(cluster.run_dir)
    leave(run, lambda: _run_script("ceph-down.sh", run, stop_timeout))


@contextlib.contextmanager
def ceph_cluster() -> Iterator[CephS3]:
    """Yield the local cluster's S3 endpoint and credentials; see the module docstring.

    Raises:
        CephStartError: The cluster could not be started.
    """
    cluster = acquire()
    try:
        yield cluster
    finally:
        release(cluster)


def stop_rgw(cluster: CephS3, sig: int = signal.SIGKILL) -> None:
    """Stop radosgw of ``cluster`` (SIGKILL by default, as a crash) and wait until it is gone.

    For fault tests. Every user of the shared cluster sees the outage, so call it only from
    tests that own the machine (CI) or accept that other sessions' requests fail meanwhile.
    """
    pid_file = Path(cluster.run_dir) / "pid" / "rgw"
    pid = int(pid_file.read_text())
    environ = Path(f"/proc/{pid}/environ")
    try:
        if f"CEPH_CONF={cluster.run_dir}/ceph.conf".encode() not in environ.read_bytes():
            raise CephStartError(f"pid {pid} in {pid_file} is not this cluster's radosgw")
        os.kill(pid, sig)
    except (FileNotFoundError, ProcessLookupError):
        return  # already gone
    deadline = time.monotonic() + 30
    while _answers(cluster.endpoint_url, timeout=0.5) or _pid_is_process(pid):
        if time.monotonic() > deadline:
            raise CephStartError(f"radosgw (pid {pid}) did not stop within 30 s")
        time.sleep(0.05)


def start_rgw(cluster: CephS3, timeout: float = 60.0) -> None:
    """Start radosgw of ``cluster`` again (after :func:`stop_rgw`) and wait until it answers."""
    run = Path(cluster.run_dir)
    env = {**os.environ, "CEPH_CONF": str(run / "ceph.conf")}
    with open(run / "log" / "rgw.stdout", "ab") as log:
        proc = subprocess.Popen(
            ["radosgw", "-f", "-n", "client.rgw.local"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not in the test runner's process group (Ctrl-C)
        )
    (run / "pid" / "rgw").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while not _answers(cluster.endpoint_url, timeout=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise CephStartError(
                f"radosgw did not come back on {cluster.endpoint_url}; see {run}/log"
            )
        time.sleep(0.05)


def _pid_is_process(pid: int) -> bool:
    """True while ``pid`` is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def is_sole_user(cluster: CephS3) -> bool:
    """True if no other live process uses the cluster (so a fault test may restart radosgw)."""
    run = Path(cluster.run_dir)
    with locked(run):
        return live_users(run) == [os.getpid()]
