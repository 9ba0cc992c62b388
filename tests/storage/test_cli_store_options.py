"""The ``fastload`` command pointed at Ceph RGW: ``--endpoint-url``, ``--store-option``,
``--src-store-option``, the standard ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` variables, and
fast, clear failures (one stderr line per retry) when the endpoint cannot be reached.

Every case runs the installed ``fastload`` command as a subprocess, with credentials from the
environment only, no ``~/.aws`` files and no instance-metadata lookups. The only network targets
are 127.0.0.1 (radosgw, and closed ports) and the name ``nonexistent.invalid``, which never
resolves (RFC 6761).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import parse_option_value
from fastload.testing import need
from fastload.testing.ceph import CephS3

FASTLOAD = Path(sys.executable).with_name("fastload")
SECRET = "cli-secret-do-not-print-0123456789"
UNRESOLVABLE = "http://nonexistent.invalid:80"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    """The environment minus every AWS_* setting of the caller, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.pop("S3_ENDPOINT_URL", None)
    env.update(
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ACCESS_KEY_ID="AKFAKE000000000000",
        AWS_SECRET_ACCESS_KEY=SECRET,
    )
    env.update(extra)
    return env


def fastload(
    *args: str, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    need("the installed fastload command", FASTLOAD.is_file(), "pip install -e . in the venv")
    return subprocess.run(
        [str(FASTLOAD), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def _rgw_env(ceph: CephS3, **extra: str) -> dict[str, str]:
    return _env(
        AWS_ACCESS_KEY_ID=ceph.access_key_id,
        AWS_SECRET_ACCESS_KEY=ceph.secret_access_key,
        AWS_DEFAULT_REGION=ceph.region,
        **extra,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}", "n": i}) + "\n" for i in range(20)))
    return path


@pytest.fixture(scope="module")
def converted(
    ceph_s3: CephS3, s3_client: Any, corpus: Path
) -> Iterator[tuple[str, subprocess.CompletedProcess[str]]]:
    """``fastload convert small.jsonl s3://…/ds --endpoint-url RGW``, run once for the module."""
    bucket = f"fl-cli-{os.getpid()}"
    s3_client.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/ds"
    args = ("convert", str(corpus), url, "--endpoint-url", ceph_s3.endpoint_url)
    result = fastload(*args, "--shard-samples", "8", "--workers", "1", env=_rgw_env(ceph_s3))
    yield url, result
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
        if keys:
            s3_client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    s3_client.delete_bucket(Bucket=bucket)


# ---- against the Ceph RGW -----------------------------------------------------------------------


@pytest.mark.ceph
def test_convert_to_rgw_with_endpoint_url(
    converted: tuple[str, subprocess.CompletedProcess[str]], s3_client: Any
) -> None:
    url, result = converted
    assert result.returncode == 0, result.stderr
    assert "converted 20 samples" in result.stdout + result.stderr
    bucket = url[len("s3://") :].split("/")[0]
    keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]}
    shards = {f"ds/shard-{n:06d}.tar" for n in range(3)}
    assert keys == {"ds/fastload.json"} | shards | {f"{s}.idx" for s in shards}


@pytest.mark.ceph
def test_inspect_endpoint_url_beats_the_environment(
    ceph_s3: CephS3, converted: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    url, _ = converted
    dead = f"http://127.0.0.1:{_closed_port()}"
    env = _rgw_env(ceph_s3, AWS_ENDPOINT_URL=dead, AWS_ENDPOINT_URL_S3=dead)
    result = fastload("inspect", url, "--json", "--endpoint-url", ceph_s3.endpoint_url, env=env)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert (info["url"], info["num_samples"], info["num_shards"]) == (url, 20, 3)
    assert result.stderr == ""  # no retries


@pytest.mark.ceph
def test_verify_with_endpoint_url(
    ceph_s3: CephS3, converted: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    url, _ = converted
    result = fastload("verify", url, "--endpoint-url", ceph_s3.endpoint_url, env=_rgw_env(ceph_s3))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"OK: checked 3 shards, read 20 samples at {url}"


@pytest.mark.ceph
def test_index_takes_the_endpoint_from_aws_endpoint_url_s3(
    ceph_s3: CephS3, converted: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    url, _ = converted
    dead = f"http://127.0.0.1:{_closed_port()}"
    # As boto3 does: the S3-specific variable wins over the generic one.
    env = _rgw_env(ceph_s3, AWS_ENDPOINT_URL=dead, AWS_ENDPOINT_URL_S3=ceph_s3.endpoint_url)
    result = fastload("index", url, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"webdataset: wrote 0 index files, 3 were up to date at {url}\n"


@pytest.mark.ceph
def test_src_store_option_reads_from_rgw_into_a_local_directory(
    ceph_s3: CephS3, converted: tuple[str, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    url, _ = converted
    out = tmp_path / "local"
    result = fastload(
        "convert",
        url,
        str(out),
        "--src-store-option",
        f"endpoint_url={ceph_s3.endpoint_url}",
        "--store-option",
        "fsync=false",  # a bool for the local DST store
        "--workers",
        "1",
        "--quiet",
        env=_rgw_env(ceph_s3),
    )
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "fastload.json").read_text())
    assert sum(s["num_samples"] for s in manifest["shards"]) == 20


# ---- options reach the backend ------------------------------------------------------------------


def test_store_option_values_are_typed() -> None:
    assert [parse_option_value(v) for v in ("true", "False", "8", "-3", "0.5", "1e3")] == [
        True,
        False,
        8,
        -3,
        0.5,
        1000.0,
    ]
    assert parse_option_value("us-east-1") == "us-east-1"
    assert parse_option_value("http://127.0.0.1:7480") == "http://127.0.0.1:7480"


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (
            "part_size=1024",
            "part_size must be at least 5242880 bytes (S3's minimum part), got 1024",
        ),
        ("no_such=1", "unknown s3 store option(s) ['no_such']; accepted: ['access_key_id',"),
    ],
)
def test_store_options_reach_the_s3_backend(option: str, error: str) -> None:
    result = fastload("inspect", "s3://bkt/ds", "--store-option", option, env=_env())
    assert result.returncode == 1
    assert result.stderr.startswith(f"fastload inspect: error: {error}")


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ("inspect", "./ds", "--endpoint-url", "http://127.0.0.1:7480"),
            "--endpoint-url applies to s3:// URLs, and URL is not one ('./ds')",
        ),
        (
            ("convert", "a.jsonl", "out", "--endpoint-url", "http://127.0.0.1:7480"),
            "--endpoint-url applies to s3:// URLs, and neither SRC nor DST is one",
        ),
        (
            ("verify", "s3://b/ds", "--store-option", "region=a", "--store-option", "region=b"),
            "--store-option region=... is given twice",
        ),
        (
            ("verify", "s3://b/ds", "--store-option", SECRET),
            "argument --store-option: expected KEY=VALUE",
        ),
        (
            ("verify", "s3://b/ds", "--store-option", "read-only=true"),
            "'read-only' is not an option name such as endpoint_url or read_only "
            "(did you mean read_only?)",
        ),
    ],
    ids=["endpoint-local", "endpoint-local-convert", "twice", "no-equals", "dashes"],
)
def test_bad_store_options_are_usage_errors(args: tuple[str, ...], error: str) -> None:
    result = fastload(*args, env=_env())
    assert result.returncode == 2
    assert error in result.stderr
    assert SECRET not in result.stderr + result.stdout


# ---- unreachable endpoints fail fast, one line per retry ----------------------------------------


def test_refused_endpoint_fails_fast_with_retry_lines(corpus: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    began = time.monotonic()
    result = fastload("convert", str(corpus), "s3://bkt/x", "--endpoint-url", endpoint, env=_env())
    assert time.monotonic() - began < 10  # was ~20 s of silent retries
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    fact = f"cannot head s3://bkt/x/fastload.json: connection refused by {endpoint}"
    assert [line.split(" in ")[0] for line in lines[:2]] == [
        "fastload convert: retrying (1/2)",
        "fastload convert: retrying (2/2)",
    ]
    assert all(line.endswith(f" s: {fact}") for line in lines[:2])
    assert len(lines) == 3
    assert lines[2].startswith(
        "fastload convert: error: head s3://bkt/x/fastload.json failed: no connection to the "
        "server could be made; gave up after 3 attempts in "
    )
    assert "check that the S3 server is running there" in lines[2]
    assert "--endpoint-url" in lines[2]
    assert SECRET not in result.stderr + result.stdout


def test_unresolvable_endpoint_fails_after_one_retry() -> None:
    began = time.monotonic()
    result = fastload("verify", "s3://bkt/ds", "--endpoint-url", UNRESOLVABLE, env=_env())
    assert time.monotonic() - began < 10
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("fastload verify: retrying (1/1) in ")
    assert (
        lines[0]
        .split(" s: ", 1)[1]
        .startswith(
            f"cannot read s3://bkt/ds/fastload.json: the host name of {UNRESOLVABLE} does not "
            "resolve ("  # then the resolver's words, e.g. "[Errno -2] Name or service not known"
        )
    )
    assert "the server's host name does not resolve; gave up after 2 attempts" in lines[1]
    assert "check the host name of the endpoint" in lines[1]


def test_quiet_convert_prints_the_error_but_no_retry_lines(corpus: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    result = fastload(
        "convert", str(corpus), "s3://bkt/x", "--endpoint-url", endpoint, "-q", env=_env()
    )
    assert result.returncode == 1
    assert "retrying" not in result.stderr
    assert result.stderr.startswith("fastload convert: error: head s3://bkt/x/fastload.json")
