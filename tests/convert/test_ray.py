"""``convert(..., executor="ray")`` on a real local Ray runtime (2 CPUs, loopback): the executor
conformance suite (:mod:`fastload.testing.executors`: the same bytes as the local executor for
any partitioning, a Ray worker killed mid-shard and retried by Ray, a failing task that stops
the run and a re-run that resumes it, a killed driver, the local Ceph RGW as source and
destination)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from fastload.convert._ray import IN_FLIGHT_PER_CPU
from fastload.testing import need
from fastload.testing.executors import ExecutorTests
from fastload.testing.hdfs import hdfs_cluster  # noqa: F401 - the HDFS test's fixture

try:
    import ray
except ImportError:  # pragma: no cover - the ray extra is in dev
    ray = None


class TestRayExecutor(ExecutorTests):
    executor = "ray"
    ahead = 2 * IN_FLIGHT_PER_CPU  # 2 CPUs
    cancels_running = (
        False  # the outstanding tasks finish their shards (see fastload/convert/_ray.py)
    )
    #: The runtime's address, for the command line and other processes.
    address: ClassVar[str] = ""

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls) -> Iterator[None]:
        """A Ray runtime for the class (2 CPUs, no dashboard, loopback)."""
        need("Ray", ray is not None, "pip install 'fastload[ray]' (or '.[dev]')")
        ray.init(
            num_cpus=2,
            address="local",
            include_dashboard=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",  # loopback only
        )
        cls.address = ray.get_runtime_context().gcs_address
        try:
            yield
        finally:
            ray.shutdown()

    def cli_options(self) -> list[str]:
        return ["--executor", "ray", "--ray-address", self.address]

    def driver(self) -> tuple[list[str], dict[str, Any]]:
        return ["--executor", "ray"], {"RAY_ADDRESS": self.address}
