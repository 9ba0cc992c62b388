"""What every local test cluster (Ceph, SLURM, ...) does the same way: run its ``tools/*-up.sh`` /
``*-down.sh`` script, and count the test processes that use it so that the last one stops it.

A cluster lives in a run directory (``$CEPH_RUN``, ``$SLURM_RUN``). Users are files
``<run>/users/<pid>`` (a dead pid's file is removed when counted), guarded by the lock file
``<run parent>/.<run name>.lock``; ``<run>/fixture-started`` marks a cluster a test session started
(one started by hand is never stopped by tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from fastload._fsutil import pid_alive

__all__ = ["join", "leave", "live_users", "locked", "run_tool_script", "tools_dir"]


def tools_dir() -> Path:
    """Where the cluster scripts live: ``$FASTLOAD_TOOLS`` or the checkout's ``tools/``."""
    env = os.environ.get("FASTLOAD_TOOLS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "tools"


def run_tool_script(
    name: str,
    run: Path,
    *,
    run_var: str,
    timeout: float,
    error: type[Exception],
    hint: str,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``tools/<name>`` with ``run_var`` set to ``run``; its output, captured.

    Raises:
        error: The script is missing, failed (the message has its stderr and ``hint``) or did
            not finish within ``timeout`` seconds.
    """
    script = tools_dir() / name
    if not script.is_file():
        raise error(
            f"{script} not found; run from a fastload checkout or set FASTLOAD_TOOLS to its tools/"
        )
    try:
        proc = subprocess.run(
            ["bash", str(script)],
            env={**os.environ, **(env or {}), run_var: str(run)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise error(f"{name} did not finish within {timeout} s (logs: {run}/log)") from exc
    if proc.returncode != 0:
        raise error(
            f"{name} failed with exit code {proc.returncode}:\n{proc.stderr.strip()}\n"
            f"(logs: {run}/log; to fix: {hint})"
        )
    return proc


@contextlib.contextmanager
def locked(run: Path) -> Iterator[None]:
    """Hold the cluster's lock (an exclusive ``flock`` beside ``run``)."""
    lock = run.parent / f".{run.name}.lock"
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def live_users(run: Path) -> list[int]:
    """The pids of the live processes counted as users (dead ones' files are removed)."""
    users = run / "users"
    live = []
    for entry in users.glob("*") if users.is_dir() else ():
        pid = int(entry.name) if entry.name.isdigit() else -1
        if pid > 0 and pid_alive(pid):
            live.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return live


def join(run: Path, *, started: bool) -> None:
    """Count this process as a user (call with the lock held); ``started``: this process started
    the cluster, so the last user stops it."""
    if started:
        (run / "fixture-started").touch()
    (run / "users").mkdir(exist_ok=True)
    (run / "users" / str(os.getpid())).touch()


def leave(run: Path, stop: Callable[[], object]) -> None:
    """Stop counting this process; call ``stop()`` if a test session started the cluster and no
    live user is left."""
    if not run.is_dir():
        return
    with locked(run):
        (run / "users" / str(os.getpid())).unlink(missing_ok=True)
        if (run / "fixture-started").exists() and not live_users(run):
            stop()
