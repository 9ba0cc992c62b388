"""The loader under faults: workers killed mid-epoch, hung, or killed by SIGBUS from a shard truncated
while it is memory-mapped. Each case asserts the typed error, the worker and the sample (shard URL,
position) it names, and that it comes quickly (a hang fails the time limit).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import resource
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.errors import WorkerError
from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
from fastload.formats.webdataset.index import parse_index
from fastload.storage import LocalStore

#: Seconds within which a fault must surface as an error (torch checks workers every 5 s at worst).
FAULT_S = 15.0


def key_of(shard: int, pos: int) -> str:
    return f"s{shard:03d}/k{pos:05d}"


def build_wds(root: Path, sizes: list[int], payload: int = 16) -> Path:
    """A local WebDataset (with indexes and a manifest) of ``sizes[s]`` samples in shard ``s``;
    sample (s, p) has key ``key_of(s, p)``, ``cls`` = s*1000+p and ``payload`` bytes in ``bin``."""
    store = LocalStore(str(root))
    fmt = get_format("webdataset")
    entries = []
    for s, n in enumerate(sizes):
        w = fmt.writer(store, f"train-{s:06d}.{fmt.extension}")
        for p in range(n):
            w.write(
                {"__key__": key_of(s, p), "cls": s * 1000 + p, "bin": bytes([p % 256]) * payload}
            )
        entries.append(ShardEntry.from_info(w.close()))
    write_manifest(store, Manifest(format=fmt.name, shards=entries))
    return root


def keys_collate(samples: list[Any]) -> list[str]:
    return [s["__key__"] for s in samples]


def no_core_dumps(worker_id: int) -> None:
    """worker_init_fn: a worker killed by SIGBUS/SIGSEGV must not write a core file."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class StallAt:
    """A transform that, on the sample with key ``key``, writes its process id to ``marker`` and
    sleeps (so that the test can kill or time out the worker at a known sample)."""

    def __init__(self, key: str, marker: Path, sleep_s: float = 60.0) -> None:
        self.key, self.marker, self.sleep_s = key, marker, sleep_s

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] == self.key:
            tmp = self.marker.with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            tmp.rename(self.marker)
            time.sleep(self.sleep_s)
        return sample


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (from /proc/<pid>/stat; the name may hold spaces)."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def kill_when_marked(marker: Path, found: dict[str, int]) -> threading.Thread:
    """A thread that waits for ``marker``, checks that the pid in it is a child of this process
    (a DataLoader worker), and SIGKILLs it."""

    def run() -> None:
        deadline = time.monotonic() + FAULT_S
        while not marker.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        pid = int(marker.read_text())
        found["pid"], found["ppid"] = pid, parent_of(pid)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def drain(batches: Iterable[list[str]], got: list[str]) -> None:
    """Collect the keys of ``batches`` into ``got`` until they end (or raise)."""
    for batch in batches:
        got.extend(batch)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- SIGKILL of a worker mid-epoch -------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_sigkilled_worker_is_named_with_its_shard_then_the_loader_recovers(
    tmp_path: Path, persistent: bool
) -> None:
    root = build_wds(tmp_path / "ds", [8, 8])
    marker = tmp_path / "worker.pid"
    # Dataset order, batch 2: key s001/k00003 is dataset index 11, in global step 5, which is
    # worker 1's (worker w of 2 builds steps w, w + 2, ...).
    ds = fastload.open_dataset(root, shuffle=False, transform=StallAt(key_of(1, 3), marker))
    loader = fastload.DataLoader(
        ds, batch_size=2, num_workers=2, collate_fn=keys_collate, persistent_workers=persistent
    )
    found: dict[str, int] = {}
    killer = kill_when_marked(marker, found)
    got: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        drain(loader, got)
    elapsed = time.monotonic() - t0
    killer.join()
    assert found["ppid"] == os.getpid()  # a real worker process of this loader was killed
    assert elapsed < FAULT_S
    url = ds.shard_url(1)
    assert url.endswith("/train-000001.tar")
    message = str(err.value)
    # The main process may notice the death while it still waits for one of worker 1's earlier
    # steps (3 or 5, depending on load): the report names the step it waited for and, exactly,
    # where the dead worker was.
    assert re.search(
        rf"rank 0, waiting for global step [35] of epoch 0; worker 1 \(pid {found['pid']}, "
        rf"killed by SIGKILL\) died at global step 5 processing sample at position 3 of shard "
        rf"{re.escape(url)} \(dataset index 11\)",
        message,
    ), message
    assert "worker 0" not in message  # the live worker is not blamed
    expected = [key_of(0, p) for p in range(8)] + [key_of(1, p) for p in range(2)]
    assert got == expected[: len(got)]  # what came before the death came in order, once
    assert len(got) >= 6
    # The failed iteration's workers are gone at once, and the next iteration starts fresh ones.
    assert not any(alive(p.pid) for p in multiprocessing.active_children() if p.pid)
    ds.transform = None
    loader = fastload.DataLoader(
        ds, batch_size=2, num_workers=2, collate_fn=keys_collate, persistent_workers=persistent
    )
    assert [k for b in loader for k in b] == [key_of(s, p) for s in range(2) for p in range(8)]


@pytest.mark.timeout(60)
def test_persistent_workers_restart_after_a_worker_death(tmp_path: Path) -> None:
    """With persistent workers the torch iterator outlives an epoch: after a death the loader
    must not reuse it (its workers are dead or mid-epoch); the next epoch runs on new workers."""
    root = build_wds(tmp_path / "ds", [8, 8])
    marker = tmp_path / "worker.pid"
    ds = fastload.open_dataset(root, shuffle=False, transform=StallAt(key_of(0, 5), marker))
    loader = fastload.DataLoader(
        ds, batch_size=2, num_workers=2, collate_fn=keys_collate, persistent_workers=True
    )
    found: dict[str, int] = {}
    kill_when_marked(marker, found)
    with pytest.raises(WorkerError, match=r"worker 0 \(pid \d+, killed by SIGKILL\) died"):
        list(loader)
    ds.transform = None  # new workers are forked from this state
    loader.set_epoch(1)
    t0 = time.monotonic()
    keys = [k for b in loader for k in b]
    assert time.monotonic() - t0 < FAULT_S
    assert sorted(keys) == [key_of(s, p) for s in range(2) for p in range(8)]


@pytest.mark.timeout(60)
def test_hung_worker_times_out_naming_its_sample(tmp_path: Path) -> None:
    root = build_wds(tmp_path / "ds", [8, 8])
    marker = tmp_path / "worker.pid"
    # s000/k00006 is in global step 3, worker 1's; it stalls 3 s, past the 1 s timeout.
    stall = StallAt(key_of(0, 6), marker, sleep_s=3.0)
    ds = fastload.open_dataset(root, shuffle=False, transform=stall)
    loader = fastload.DataLoader(
        ds, batch_size=2, num_workers=2, collate_fn=keys_collate, timeout=1
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        list(loader)
    assert time.monotonic() - t0 < FAULT_S
    pid = int(marker.read_text())
    message = str(err.value)
    assert (
        "rank 0, waiting for global step 3 of epoch 0; worker 0 (pid "
    ) in message  # a timeout names every worker: none is known dead
    assert (
        f"worker 1 (pid {pid}) was at global step 3 processing sample at position 6 of shard "
        f"{ds.shard_url(0)} (dataset index 6)"
    ) in message
    assert "DataLoader timed out after 1 seconds" in message
    assert not alive(pid)  # the hung worker was shut down, not left behind


# ---- a shard truncated while it is read (SIGBUS in the reads that run ahead of decoding) ---------


_DEATH = re.compile(
    r"worker (\d) \(pid \d+, killed by SIGBUS\) died at global step (\d+) while reading sample at "
    r"position (\d+) of shard (\S+) \(dataset index (\d+)\) for global step (\d+)"
)


@pytest.mark.timeout(60)
def test_shard_truncated_while_mapped_names_the_read_that_faulted(tmp_path: Path) -> None:
    # Shard 0: one sample; shard 1: 48 samples of ~9.7 KB (a 16 KiB-ish stride of pages).
    root = build_wds(tmp_path / "ds", [1, 48], payload=8192)
    shard = root / "train-000001.tar"
    index = parse_index((root / "train-000001.tar.idx").read_bytes())
    ends = [max(c.offset + c.size for c in comps) for comps in index]
    cut = (index[24][0].offset - 512) // 4096 * 4096  # page-aligned, in front of sample 24
    ds = fastload.open_dataset(root, shuffle=False)
    assert ds.store.has_local_paths  # memory-mapped reads, in the worker's own thread
    loader = fastload.DataLoader(
        ds,
        batch_size=2,
        num_workers=2,
        collate_fn=keys_collate,
        prefetch_factor=1,
        worker_init_fn=no_core_dumps,
    )
    # Batch 0 = [s000/k00000, s001/k00000] (worker 0), batch 1 = [s001/k00001, s001/k00002]
    # (worker 1): once both arrived, both workers have shard 1 mapped, and neither has read past
    # step 5 (prefetch_factor=1: one task each, one batch of reads ahead).
    got: list[str] = []
    it = iter(loader)
    for _ in range(2):
        got.extend(next(it))
    os.truncate(shard, cut)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        drain(it, got)
    assert time.monotonic() - t0 < FAULT_S
    message = str(err.value)
    # Which worker's read faults first: the first of its samples (dataset index 2k, 2k + 1 for
    # its steps k = w, w + 2, ...) whose bytes reach past the cut.
    first_fault = {}
    for w in (0, 1):
        positions = [i - 1 for k in range(w, 25, 2) for i in (2 * k, 2 * k + 1) if i >= 1]
        first_fault[w] = next(p for p in positions if ends[p] > cut)
    url = ds.shard_url(1)
    if "killed by SIGBUS" in message:
        deaths = _DEATH.findall(message)
        assert deaths, message
        for worker, _step, pos, named, index_, read_step in deaths:
            assert named == url
            assert int(pos) == first_fault[int(worker)]
            assert int(index_) == int(pos) + 1
            assert int(read_step) == (int(pos) + 1) // 2
        assert "a shard that shrank (truncated or rewritten in place)" in message
        assert f"fastload verify {ds.url}" in message
    else:  # the reader caught the truncation itself: a typed error from the worker, same culprit
        typed = re.search(
            rf"worker (\d), global step \d+: reading sample at position (\d+) of shard "
            rf"{re.escape(url)} failed: CorruptDataError",
            message,
        )
        assert typed is not None, message
        assert int(typed[2]) == first_fault[int(typed[1])]
    # Everything delivered before the fault is intact and in order.
    assert got == [key_of(0, 0)] + [key_of(1, p) for p in range(len(got) - 1)]
