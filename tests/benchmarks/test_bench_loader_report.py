"""``bench_loader``'s report from synthetic runs: medians of the epoch and steady rates, first
batch and CPU per sample, the ratios on the epoch rate (and on the steady rate), the 2-core limit.
No loader runs here; the children's timing is :func:`benchmarks._harness.time_epoch`'s (tested in
test_bench_harness.py)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.bench_loader import _report

COUNT = 1000


def run(epoch_s: float, steady_rate: float, first: float, cpu_s: float) -> dict[str, Any]:
    """A time_epoch result of one epoch of COUNT samples, 900 of them in the steady span."""
    return {
        "samples": COUNT,
        "seconds": epoch_s,
        "epoch_seconds": epoch_s,
        "first_batch_seconds": first,
        "steady_samples": 900,
        "steady_seconds": 900 / steady_rate,
        "batches": 10,
        "cpu_seconds": cpu_s,
        "steady_cpu_seconds": cpu_s * 0.8,
    }


def test_report_takes_medians_and_ratios_on_the_epoch_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = {
        "bytes": {
            "pagecache": [{"bytes": 100e6, "seconds": 0.1, "samples": COUNT}],
            "fastload": [
                run(0.5, 4000, 0.2, 0.2),
                run(0.25, 5000, 0.1, 0.1),
                run(1.0, 3000, 0.4, 0.3),
            ],
            "torch": [run(1.0, 1500, 0.3, 0.5)],
            "webdataset": [run(0.8, 2000, 0.3, 0.4), {"error": "exit 1: boom"}],
        },
        "train": {
            "single-fused": [{"samples": 600, "seconds": 1.0}],
            "fastload": [run(2.0, 600, 0.5, 2.0)],
            "dali": [run(4.0, 300, 0.2, 2.5)],
            "torch": [run(5.0, 250, 0.8, 3.0)],
        },
    }
    report = _report(results, 100.0, {"litdata": "missing"}, COUNT)
    b = report["workloads"]["bytes"]
    assert b["rates"]["fastload"] == 2000.0  # median of 2000, 4000, 1000 samples/s
    assert b["steady_rates"]["fastload"] == 4000.0
    assert b["first_batch_seconds"]["fastload"] == 0.2
    assert b["cpu_us_per_sample"]["fastload"] == pytest.approx(200.0)  # 0.2 s / 1000
    assert b["steady_cpu_us_per_sample"]["fastload"] == pytest.approx(0.16 / 900 * 1e6)
    assert b["rates"]["webdataset"] == 1250.0  # the failed round is left out
    assert b["rounds"] == {"pagecache": 1, "fastload": 3, "torch": 1, "webdataset": 2}
    assert b["pagecache_bytes_per_s"] == 1e9
    t = report["workloads"]["train"]
    assert t["two_core_limit"] == 1200.0
    assert t["rates"] == {"single-fused": 600.0, "fastload": 500.0, "dali": 250.0, "torch": 200.0}
    assert report["skipped"] == {"litdata": "missing"}
    out = capsys.readouterr().out
    # bytes: epoch 2000/s, steady 4000/s, 0.20 s, 200 MB/s; vs torch 2.00x; vs best peer
    # (webdataset: 1250 epoch, 2000 steady) 1.60x and 2.00x; 20.0% of the page cache; 200 us
    fastload_bytes = next(ln for ln in out.splitlines() if ln.startswith("fastload "))
    assert fastload_bytes.split()[1:] == [
        "2000", "4000", "0.20", "200", "2.00x", "1.60x", "2.00x", "20.0%", "200"
    ]  # fmt: skip
    # train: vs DALI 2.00x (epoch) and 2.00x (steady 600/300); vs torch (the only PIL peer)
    # 2.50x and 2.40x; 42% of the 2-core limit; 2.00 CPU-ms/img
    fastload_train = [ln for ln in out.splitlines() if ln.startswith("fastload ")][1]
    assert fastload_train.split()[1:] == [
        "500", "600", "0.50", "2.00x", "2.00x", "2.50x", "2.40x", "42%", "2.00"
    ]  # fmt: skip
