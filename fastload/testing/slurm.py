"""Start or reuse the local one-node SLURM cluster (``tools/slurm-up.sh``) from tests.

:func:`acquire` returns the cluster in ``$SLURM_RUN`` (default ``/tmp/fastload-slurm``): it reuses
one whose node answers, starts one otherwise (about 1 s), and counts this process as a user;
:func:`release` stops the cluster only if a test session started it and no other live process
still uses it, as :mod:`fastload.testing.ceph` does for Ceph. A cluster started by hand with
``tools/slurm-up.sh`` is never stopped here.

Needs root and the Debian packages ``slurmctld slurmd slurm-client munge``; :func:`slurm_missing`
says which programs are absent.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

from fastload.errors import FastloadError
from fastload.testing._clusters import join, leave, locked, run_tool_script

__all__ = ["INSTALL_HINT", "Slurm", "SlurmStartError", "acquire", "release", "slurm_missing"]

#: What to run when the cluster cannot be started.
INSTALL_HINT = (
    "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge "
    "(tools/system-deps.sh), then tools/slurm-up.sh as root"
)
_PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "srun")


class SlurmStartError(FastloadError, RuntimeError):
    """The local SLURM cluster could not be started; the message has the script's output."""


@dataclasses.dataclass(frozen=True)
class Slurm:
    """A running local cluster.

    Attributes:
        conf: Its ``slurm.conf``: set ``SLURM_CONF`` to it for ``srun``, ``sbatch``, ``sinfo``.
        run_dir: The cluster's ``$SLURM_RUN`` directory (config, logs, pids).
        started: True if this process started the cluster.
    """

    conf: str
    run_dir: str
    started: bool = False

    def env(self) -> dict[str, str]:
        """``os.environ`` with ``SLURM_CONF`` pointing at this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf}


def run_dir() -> Path:
    """The cluster directory: ``$SLURM_RUN`` or ``/tmp/fastload-slurm``."""
    return Path(os.environ.get("SLURM_RUN", "/tmp/fastload-slurm"))


def slurm_missing() -> list[str]:
    """What the scripts need that is missing: programs not on ``PATH``, and root."""
    missing = [p for p in _PROGRAMS if shutil.which(p) is None]
    if os.geteuid() != 0:
        missing.append("root (slurmd)")
    return missing


def _run_script(name: str, run: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_tool_script(
        name, run, run_var="SLURM_RUN", timeout=timeout, error=SlurmStartError, hint=INSTALL_HINT
    )


def acquire(start_timeout: float = 120.0) -> Slurm:
    """Reuse the running cluster or start one, and count this process as a user.

    Raises:
        SlurmStartError: Programs or root are missing, or ``slurm-up.sh`` failed.
    """
    missing = slurm_missing()
    if missing:
        raise SlurmStartError(f"{', '.join(missing)} missing; {INSTALL_HINT}")
    run = run_dir()
    run.parent.mkdir(parents=True, exist_ok=True)
    with locked(run):
        # slurm-up.sh reuses a cluster that answers, and says so
        started = "reusing" not in _run_script("slurm-up.sh", run, start_timeout).stderr
        join(run, started=started)
        return Slurm(conf=str(run / "slurm.conf"), run_dir=str(run), started=started)


def release(cluster: Slurm, stop_timeout: float = 60.0) -> None:
    """Stop counting this process; stop the cluster if a test session started it and it is unused."""
    run = Path(cluster.run_dir)
    leave(run, lambda: _run_script("slurm-down.sh", run, stop_timeout))
