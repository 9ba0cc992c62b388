"""``bench_memory``'s child and summary on a tiny corpus: what the benchmark states per process.

The child runs fastload's bytes loader (2 workers) for a few epochs in this process and samples
the tree with :func:`benchmarks._harness.tree_memory`; the test checks what it reports (both
workers seen mid-epoch, sane RSS/PSS figures, every sample delivered) and the growth arithmetic
of :func:`benchmarks.bench_memory.summarize` on synthetic samples. About 5 s on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.bench_memory import child, summarize
from benchmarks.corpus import ensure_corpus

COUNT = 48


@pytest.fixture(scope="module")
def tiny_wds(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("w1-tiny")
    corpus = ensure_corpus(COUNT, root / "w1", processes=2, verbose=False)
    return str(corpus.webdataset(shards=4, workers=2))


@pytest.mark.parametrize("persistent", [False, True])
def test_child_samples_main_and_both_workers_every_epoch(tiny_wds: str, persistent: bool) -> None:
    spec = {"workload": "bytes", "persistent": persistent, "epochs": 3, "batch": 4}
    res = child({**spec, "count": COUNT, "wds": tiny_wds})
    epochs = res["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    for e in epochs:
        roles = sorted(r["role"] for r in e["mid"])
        assert roles == ["main", "worker", "worker"]
        after = sorted(r["role"] for r in e["after"])
        # fresh workers per epoch are gone once the epoch is over; persistent ones stay
        assert after == (["main", "worker", "worker"] if persistent else ["main"])
        for r in e["mid"]:
            assert r["rss_kb"] > 10_000  # a Python interpreter with torch: tens of MB
            assert 0 < r["pss_kb"] <= r["rss_kb"]
            assert 0 <= r["pss_file_kb"] < r["pss_kb"]
        assert e["rate"] > 0
    pids = [sorted(r["pid"] for r in e["mid"] if r["role"] == "worker") for e in epochs]
    if persistent:
        assert pids[0] == pids[1] == pids[2]
    else:
        assert len({tuple(p) for p in pids}) == 3
    summary = summarize(epochs)
    assert [r["workers"] for r in summary["epochs"]] == [2, 2, 2]
    assert set(summary["growth_from_epoch_2"]) == {
        "main_rss", "main_pss", "main_own", "main_anon",
        "worker_rss", "worker_pss", "worker_own", "worker_anon", "tree_pss"
    }  # fmt: skip


def _sample(epoch: int, main_kb: int, workers_kb: list[int]) -> dict[str, Any]:
    def row(pid: int, role: str, kb: int) -> dict[str, Any]:
        pss = {"pss_kb": kb // 2, "pss_file_kb": kb // 8}
        return {"pid": pid, "role": role, "rss_kb": kb, "anon_kb": kb // 4, **pss}

    mid = [row(1, "main", main_kb)] + [row(10 + i, "worker", kb) for i, kb in enumerate(workers_kb)]
    mid.append(row(99, "python resource_tracker", 4096))  # neither main nor a worker
    return {"epoch": epoch, "rate": 100.0, "mid": mid, "after": [row(1, "main", main_kb)]}


def test_summarize_reports_megabytes_and_growth_from_epoch_2() -> None:
    epochs = [
        _sample(1, 1024 * 100, [1024 * 400, 1024 * 300]),
        _sample(2, 1024 * 200, [1024 * 400, 1024 * 300]),
        _sample(3, 1024 * 200, [1024 * 404, 1024 * 340]),
        _sample(4, 1024 * 208, [1024 * 408, 1024 * 340]),
    ]
    s = summarize(epochs)
    first = s["epochs"][0]
    assert first["main_rss"] == 100.0
    assert first["main_pss"] == 50.0
    assert first["worker_rss"] == [400.0, 300.0]
    assert first["worker_anon"] == [100.0, 75.0]
    assert first["worker_own"] == [150.0, 112.5]  # PSS less the mapped files' share
    assert first["tree_pss"] == (100 + 400 + 300 + 4) / 2  # every process of the tree
    g = s["growth_from_epoch_2"]
    assert g["main_rss"] == 8.0  # epoch 2 -> 4, not epoch 1 -> 4
    assert g["worker_rss"] == 40.0  # the larger of the two workers' growth
    assert g["worker_pss"] == 20.0
    assert g["worker_own"] == 15.0
    assert g["tree_pss"] == (8 + 8 + 40) / 2
