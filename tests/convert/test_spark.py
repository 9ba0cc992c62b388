"""``convert(..., executor="spark")`` on a real local Spark application (``local[2]``, loopback,
no UI): the executor conformance suite (:mod:`fastload.testing.executors`: the same bytes as the
local executor for any partitioning, a Python worker killed mid-shard and retried by Spark, a
failing task, a killed driver, the local Ceph RGW as source and destination), plus what is
Spark's own: the master given to an application the executor starts, and the errors without
pyspark or Java."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.convert import convert
from fastload.convert._spark import SPARK_TASK_ATTEMPTS, spark_conf, start_context
from fastload.errors import InvalidArgumentError, MissingDependencyError
from fastload.testing import need
from fastload.testing.executors import ExecutorTests, jsonl
from fastload.testing.hdfs import hdfs_cluster  # noqa: F401 - the HDFS test's fixture

try:
    import pyspark
except ImportError:  # pragma: no cover - the spark extra is in dev
    pyspark = None

#: The master of the tests' application: 2 cores, so 4 jobs in flight.
_MASTER = "local[2]"


def _need_spark() -> None:
    need("pyspark", pyspark is not None, "pip install 'fastload[spark]' (or '.[dev]')")
    need("Java", shutil.which("java") is not None or "JAVA_HOME" in os.environ, "install Java 17+")


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One Spark application for the module (``local[2,4]``: 2 cores, 4 attempts a task)."""
    _need_spark()
    conf = spark_conf(pyspark, _MASTER)
    conf.set("spark.ui.enabled", "false").set("spark.sql.shuffle.partitions", "2")
    sc = start_context(pyspark, conf)
    try:
        yield sc
    finally:
        sc.stop()


class TestSparkExecutor(ExecutorTests):
    executor = "spark"
    ahead = 2 * 2  # defaultParallelism 2, IN_FLIGHT_PER_CORE 2

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, spark: Any) -> None:
        """The module's application (the executor uses the active SparkContext)."""

    def driver(self) -> tuple[list[str], dict[str, str]]:
        # Another process starts its own application (the driver's JVM exits with it).
        return [*self.cli_options(), "--spark-master", _MASTER], {}


def test_the_application_the_executor_starts(spark: Any) -> None:
    assert spark.master == f"local[2,{SPARK_TASK_ATTEMPTS}]"  # a local master retries too
    if "PYSPARK_PYTHON" not in os.environ:  # the executors run this interpreter
        assert spark.getConf().get("spark.pyspark.python") == sys.executable
    for master, expected in [
        ("local", f"local[1,{SPARK_TASK_ATTEMPTS}]"),
        ("local[*]", f"local[*,{SPARK_TASK_ATTEMPTS}]"),
        ("local[3,2]", "local[3,2]"),
        ("spark://h:7077", "spark://h:7077"),
    ]:
        conf = spark_conf(pyspark, master)
        assert conf.get("spark.master") == expected, master
        assert conf.get("spark.task.maxFailures") == str(SPARK_TASK_ATTEMPTS)
        assert conf.get("spark.ui.showConsoleProgress") == "false"
        if master.startswith("local"):  # (this process's JVM has the fixture's settings)
            assert conf.get("spark.driver.host") == "127.0.0.1"


def test_spark_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    src = tmp_path / "src.jsonl"
    src.write_bytes(jsonl(10))
    with pytest.raises(InvalidArgumentError, match=r"spark_master \(--spark-master\) is not used"):
        convert(str(src), str(tmp_path / "out"), spark_master="local[2]", quiet=True)
    assert not (tmp_path / "out").exists()


def test_without_pyspark_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src.jsonl"
    src.write_bytes(jsonl(10))
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[spark\]'"):
        convert(str(src), str(tmp_path / "out"), executor="spark", quiet=True)


def test_without_java_the_error_says_so(tmp_path: Path) -> None:
    _need_spark()
    src = tmp_path / "src.jsonl"
    src.write_bytes(jsonl(10))
    no_java = tmp_path / "no-java"
    (no_java / "bin").mkdir(parents=True)
    run = subprocess.run(
        [
            *(sys.executable, "-m", "fastload.cli", "convert", str(src), str(tmp_path / "out")),
            *("--executor", "spark", "--spark-master", "local[1]", "-q"),
        ],
        env={**os.environ, "JAVA_HOME": str(no_java)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "cannot start Spark (master local[1])" in run.stderr
    assert "Spark needs Java 17 or later" in run.stderr
    assert not (tmp_path / "out" / "fastload.json").exists()
