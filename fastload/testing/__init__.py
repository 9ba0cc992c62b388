"""Test support shipped with fastload: conformance suites every implementation subclasses.

* :mod:`fastload.testing.store`: ``StoreTests`` for every storage backend and wrapper.
* :mod:`fastload.testing.formats`: ``ShardFormatTests`` for every shard format.
* :mod:`fastload.testing.streams`: stores with forward-only, short-read streams.
* :mod:`fastload.testing.resume`: ``check_resume``, the resume checker every loader passes (every
  step, other worker counts and world sizes).
* :mod:`fastload.testing.launchers`: one rank of a job under ``mpirun``/``srun`` that finds its
  place from the launcher alone; :mod:`fastload.testing.slurm` starts the local SLURM cluster.

These modules import pytest and hypothesis; they are for test suites, not for production code.
"""

from __future__ import annotations

import os

__all__ = ["in_ci", "need"]


def in_ci() -> bool:
    """True when running under CI (``CI=true``), where missing components must fail tests."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(component: str, available: bool, how_to_fix: str) -> None:
    """Skip the calling test when ``component`` is unavailable, or fail it under ``CI=true``.

    A skipped test is not a passing test: in CI, a required component (Ceph, DALI, TensorFlow)
    that is missing is an error of the CI set-up, so the test fails with the fix in its message.
    """
    if available:
        return
    import pytest

    message = f"{component} is not available: {how_to_fix}"
    if in_ci():
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)
