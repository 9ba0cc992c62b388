"""The issue's 10^8-sample point (issue 17, item 2) for ``bench_scale``'s ``epoch-1e8-*`` series.

Three pieces:

* :func:`build_sixteen`: a dataset of ``n`` ~16-byte samples (``{"cls": i % 10, "txt":
  f"{i:016d}"}``, key ``s/{i:09d}``: the samples ``fastload convert`` makes of the ``epoch``
  series' JSONL records) in shards of ``shard`` samples, written straight with the format's own
  shard writer, one shard per task of a process pool, then the manifest; built once (the
  manifest marks it complete) and reused. 10^8 samples: ~9.8 GB of LMDB, ~8.9 GB of TFRecord plus
  ~1.1 GB of indexes; ~1 s (LMDB) and ~2 s (TFRecord) of CPU per shard of 10^5 samples;
* :func:`child_epoch_1e8`: one measurement in a fresh process: ``open_dataset`` +
  ``DataLoader`` at default settings (shuffled, batch 256, 2 workers), the seconds to build them
  (``startup_s``), to the first batch (``first_batch_s``), and the rate over the next ``timed``
  samples (after the harness's 2 warm-up batches), then each worker's footprint;
* :func:`footprint`: what one process holds, from ``/proc``: open descriptors (all, and those on
  the dataset's files), the dataset's mappings (count, ``Size`` and ``Rss`` summed over
  ``/proc/PID/smaps``) and the process's anonymous and private memory (``smaps_rollup``).

Only the standard library at the top (fastload inside the functions): the parent imports this
module before it knows which series runs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._harness import child_pids as children
from benchmarks._harness import count_fds, time_batches

__all__ = ["build_sixteen", "child_epoch_1e8", "footprint"]


def _write_shard(task: tuple[str, str, int, int, int]) -> tuple[Any, dict[str, int]]:
    """Write shard ``s`` (samples ``first .. first + count - 1``); its manifest entry and field
    counts."""
    from fastload.formats import ShardEntry, get_format
    from fastload.storage import LocalStore

    root, fmt_name, s, first, count = task
    fmt = get_format(fmt_name)
    writer = fmt.writer(LocalStore(root), f"shard-{s:06d}.{fmt.extension}")
    try:
        for i in range(first, first + count):
            writer.write({"__key__": f"s/{i:09d}", "cls": i % 10, "txt": f"{i:016d}"})
        info = writer.close()
    except BaseException:
        writer.abort()
        raise
    return ShardEntry.from_info(info), info.fields


def build_sixteen(root: Path, fmt_name: str, n: int, shard: int, processes: int = 2) -> Path:
    """``n`` ~16-byte samples in shards of ``shard`` under ``root`` (see module doc), built
    unless its manifest is there; returns ``root``."""
    from fastload.formats import Manifest, write_manifest
    from fastload.storage import LocalStore

    if (root / "fastload.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    tasks = [
        (str(root), fmt_name, s, first, min(shard, n - first))
        for s, first in enumerate(range(0, n, shard))
    ]
    t0 = time.perf_counter()
    entries, fields = [], []
    with ProcessPoolExecutor(max_workers=processes) as pool:
        for done, (entry, counts) in enumerate(pool.map(_write_shard, tasks), 1):
            entries.append(entry)
            fields.append(counts)
            if done % 100 == 0:
                print(
                    f"  built {done}/{len(tasks)} shards, {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
    manifest = Manifest(
        format=fmt_name,
        shards=entries,
        schema=Manifest.schema_from_fields(fields),
        created_by={"tool": "benchmarks._scale_1e8.build_sixteen", "shard_samples": shard},
    )
    write_manifest(LocalStore(str(root)), manifest)
    print(f"  built {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


# ---- one measurement (a fresh child process) ------------------------------------------------------


def _page_cached(root: str) -> float:
    """The fraction of the dataset's bytes in the page cache (``fincore``; -1 without it)."""
    import subprocess

    files = [str(p) for p in Path(root).iterdir() if p.name != "fastload.json"]
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--raw", "--noheadings", "-o", "RES,SIZE", *files],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return -1.0
    pairs = [tuple(map(int, line.split())) for line in out.splitlines() if line.strip()]
    return sum(r for r, _ in pairs) / max(1, sum(s for _, s in pairs))


def footprint(pid: int, root: str) -> dict[str, float]:
    """What process ``pid`` holds (see module doc); sizes in MB (10^6 bytes)."""
    base = os.path.realpath(root) + os.sep
    on_data = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            on_data += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(base)
    maps = 0
    kib = {"Size:": 0, "Rss:": 0}  # summed over the dataset's mappings
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                parts = line.split(None, 5)
                inside = len(parts) == 6 and parts[5].startswith(base)
                maps += inside
            elif inside and head in kib:
                kib[head] += int(line.split()[1])
    rollup: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        rollup[key] = int(value.split()[0])
    mb = 1024 / 1e6
    return {
        "fds": count_fds(pid),
        "data_fds": on_data,
        "data_maps": maps,
        "data_map_mb": kib["Size:"] * mb,
        "data_rss_mb": kib["Rss:"] * mb,
        "rss_mb": rollup.get("Rss", 0) * mb,
        "anon_mb": rollup.get("Anonymous", 0) * mb,
        "private_mb": (rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)) * mb,
    }


def _tree_cpu() -> float:
    """CPU seconds (user + system) of this process and its live children (the loader's workers)
    so far, from ``/proc/PID/stat``; on a shared machine the CPU a sample costs moves less with
    the load than the wall time does."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in [os.getpid(), *children(os.getpid())]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


class _FirstBatch:
    """Wraps an iterator of batches; records the ``perf_counter`` time of the first batch."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches, self.at = batches, 0.0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            if not self.at:
                self.at = time.perf_counter()
            yield batch


def _worst(prints: Iterable[dict[str, float]]) -> dict[str, float]:
    """The largest of each figure over the workers."""
    out: dict[str, float] = {}
    for p in prints:
        for key, value in p.items():
            out[key] = max(out.get(key, value), value)
    return out


def child_epoch_1e8(n: int, root: str, timed: str, later: str = "0") -> dict[str, Any]:
    """One measurement of the ``epoch-1e8-*`` series (see module doc).

    ``samples_per_s`` over the first ``timed`` samples of the epoch (after 2 warm-up batches:
    every per-shard cost of a worker's first reads falls in it); with ``later`` > 0, also
    ``later_per_s`` over the ``later`` samples that follow (the steady rate, once every shard is
    open). ``cpu_us``, ``later_cpu_us``: CPU microseconds (this process and the workers, user +
    system) per sample over each span. ``epoch_per_s``: ``n`` over start-up plus the time of those spans plus the rest of the
    epoch at the last span's rate (an estimate, not a measured epoch, unless the spans cover it).
    ``startup_s`` (``open_dataset`` + ``DataLoader``), ``first_batch_s``; the workers' footprints
    at the end (``workers``: one per worker; their largest figures at the top level); the
    dataset's page-cache fraction before the start (``cached``); the 1-minute load at the end.
    """
    from fastload import DataLoader, open_dataset

    cached = _page_cached(root)
    t0 = time.perf_counter()
    loader = DataLoader(open_dataset(root, shuffle=True), batch_size=256, num_workers=2)
    startup = time.perf_counter() - t0
    batches = iter(loader)  # held until the footprints are taken: the workers stay alive
    first = _FirstBatch(batches)
    t1 = time.perf_counter()
    result = time_batches(first, int(timed), cpu_clock=_tree_cpu)
    seen, spent, rate, later_cpu = result["samples"], result["total_seconds"], 0.0, 0.0
    if int(later) > 0:  # the same iterator goes on; every sample of this span counts
        steady = time_batches(batches, int(later), warmup=0, cpu_clock=_tree_cpu)
        rate = steady["samples"] / steady["seconds"]
        later_cpu = steady["cpu_seconds"] / steady["samples"] * 1e6
        seen, spent = seen + steady["samples"], spent + steady["seconds"]
    me = Path("/proc/self/cmdline").read_bytes()  # the workers are forked: the same
    workers = [p for p in children(os.getpid()) if Path(f"/proc/{p}/cmdline").read_bytes() == me]
    prints = [footprint(pid, root) for pid in sorted(workers)]
    del batches
    first_rate = result["samples"] / result["seconds"]
    rest = max(0, n - seen) / (rate or first_rate)
    return {
        **result,
        "samples_per_s": first_rate,
        "later_per_s": rate,
        "cpu_us": result["cpu_seconds"] / result["samples"] * 1e6,
        "later_cpu_us": later_cpu,
        "epoch_per_s": n / (startup + spent + rest),
        "startup_s": startup,
        "first_batch_s": first.at - t1,
        "cached": cached,
        "load": os.getloadavg()[0],
        "workers": prints,
        **_worst(prints),
    }
