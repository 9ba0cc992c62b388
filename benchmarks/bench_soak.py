"""Soak: many epochs from the local Ceph RGW through a cache smaller than the dataset (issue 11).

A WebDataset corpus (default 32 shards x 32 samples of 32 KB, ~34 MB) is uploaded once to the bucket
``fastload-bench-soak``; ``fastload.DataLoader`` (2 workers, batch 16, the streaming shuffle) reads it
for 20 epochs through ``open_dataset(..., cache_dir=..., cache_size=<a third of the dataset>)``, so the
cache evicts every epoch. Both worker modes run: workers recreated per epoch, and persistent workers.
Each epoch checks exactly-once delivery and intact payloads, and samples the loader's process tree:

* ``main``: VmRSS of the main process after the epoch, MB;
* ``rss``/``anon``/``pss``: VmRSS, RssAnon (heap and other private memory: where a leak shows;
  VmRSS also counts the mapped shards' page cache) and PSS (``smaps_rollup``) of main + workers,
  MB, mid-epoch;
* ``fds``: open descriptors of the main process after the epoch; ``wfds``: of the workers, mid-epoch;
* ``shm``: ``/dev/shm`` entries named for the tree's pids; ``temp``: files in the (private) temp dir
  and the cache's ``tmp/`` and ``*.tmp``; ``locks``: lock files in the cache dir;
* ``held``: evicted cache files still mapped or open in the tree (disk the budget does not see);
* ``evict``/``dl MB``: evictions and bytes downloaded into the cache this epoch (workers' counters);
* ``rate``: samples/s of the epoch (worker start-up included when workers are recreated).

Flat means: fds, shm, temp and locks equal between epoch 1 and the last (epoch 0 warms up), ``held``
0, and growth of the tree's RssAnon and of the main process's RSS under 20 MB each (the lower of
epochs 1-2 against the lower of the last two: a sample caught mid-download is not a trend). The table and a PASS/FAIL line per mode are printed.
``tests/reliability/test_soak.py`` runs the same soak shortened (5 epochs, 3 MB) in CI.

Run: ``.venv/bin/python -m benchmarks.bench_soak [--quick] [--epochs N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._harness import child_pids, count_fds, status_kb

BUCKET = "fastload-bench-soak"
WORKERS = 2
BATCH = 16
#: Allowed growth of the tree's RssAnon, and of the main process's RSS (see :func:`growth_kb`).
RSS_GROWTH_KB = 20 * 1024


# ---- the corpus ---------------------------------------------------------------------------------


def key_of(shard: int, pos: int) -> str:
    """The key of sample ``pos`` of shard ``shard`` (its ``cls`` is ``shard * 1000 + pos``)."""
    return f"s{shard:03d}/k{pos:05d}"


def payload_of(key: str, size: int) -> bytes:
    """The ``bin`` field of sample ``key``: the key repeated, ``size`` bytes (a multiple of 64)."""
    return key.encode().ljust(64, b".") * (size // 64)


def write_corpus(url: str, store_options: dict[str, Any], shards: int, per: int, size: int) -> None:
    """Write the soak corpus as a WebDataset (with indexes and a manifest) to ``url``."""
    import fastload
    from fastload.formats import Manifest, ShardEntry, get_format, write_manifest

    store = fastload.open_store(url, **store_options)
    fmt = get_format("webdataset")
    entries = []
    for s in range(shards):
        w = fmt.writer(store, f"train-{s:06d}.{fmt.extension}")
        for p in range(per):
            key = key_of(s, p)
            w.write({"__key__": key, "cls": s * 1000 + p, "bin": payload_of(key, size)})
        entries.append(ShardEntry.from_info(w.close()))
    write_manifest(store, Manifest(format=fmt.name, shards=entries))


# ---- sampling the process tree ------------------------------------------------------------------


class SoakCollate:
    """Default collation plus (worker id, that worker's cache counters): evictions and downloads
    happen in the workers, whose :class:`~fastload.storage.CachingStore` counters are per process."""

    def __call__(self, samples: list[Any]) -> tuple[Any, int, dict[str, int]]:
        import torch.utils.data

        from fastload.loader import default_collate

        info = torch.utils.data.get_worker_info()
        if info is None:
            raise RuntimeError("SoakCollate runs in DataLoader workers only")
        store = info.dataset.dataset.store  # type: ignore[attr-defined]
        return default_collate(samples), info.id, store.stats()


@dataclass
class Sample:
    """One epoch of the soak (see the module docstring for each field)."""

    epoch: int
    rss_main_kb: int
    rss_tree_kb: int
    anon_tree_kb: int
    pss_tree_kb: int
    fds_main: int
    fds_workers: int
    shm: int
    temp: int
    locks: int
    held: int
    evictions: int
    downloaded_mb: float
    rate: float


def count_files(root: Path, suffix: str = "") -> int:
    """Files under ``root`` whose name ends with ``suffix``."""
    return sum(1 for _, _, names in os.walk(root) for n in names if n.endswith(suffix))


def held_deleted(pids: Sequence[int], root: Path) -> int:
    """Files under ``root`` that were deleted but are still mapped or open by ``pids``."""
    held: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                held.update(line.split(None, 5)[-1].strip() for line in f if str(root) in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sum(1 for h in held if h.startswith(str(root)) and h.endswith("(deleted)"))


def shm_entries(pids: set[int]) -> int:
    """``/dev/shm`` entries torch or fastload made for these processes (names carry the pid)."""
    tags = tuple(f"_{p}_" for p in pids)
    return sum(1 for n in os.listdir("/dev/shm") if any(t in n for t in tags))


def soak(
    loader: Any, cache: Path, temp: Path, epochs: int, keys: Sequence[str], payload: int
) -> Iterator[Sample]:
    """Run ``epochs`` epochs of ``loader`` (made with :class:`SoakCollate`), check that each
    delivers ``keys`` exactly once with intact data, and sample the process tree after each.

    Raises:
        AssertionError: An epoch delivered a sample twice, missed one, or corrupted one.
    """
    from fastload.loader import PackedBytes

    main = os.getpid()
    before = set(child_pids(main))  # not the loader's (e.g. a Ceph daemon this process started)
    seen = {main}
    everything = sorted(keys)
    persistent = bool(loader._torch_kwargs["persistent_workers"])
    last: dict[int, dict[str, int]] = {}  # persistent workers: counters after the last epoch
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        got: list[str] = []
        counters: dict[int, dict[str, int]] = {}
        rss = anon = pss = fds_workers = 0
        n = len(loader)
        t0 = time.perf_counter()
        for i, ((batch_keys, cls, blobs), worker, stats) in enumerate(loader):
            if not isinstance(blobs, PackedBytes) or [bytes(b) for b in blobs] != [
                payload_of(k, payload) for k in batch_keys
            ]:
                raise AssertionError(f"epoch {epoch}: corrupt payloads in {batch_keys}")
            if [int(c) for c in cls] != [int(k[1:4]) * 1000 + int(k[6:]) for k in batch_keys]:
                raise AssertionError(f"epoch {epoch}: labels do not match keys {batch_keys}")
            got.extend(batch_keys)
            counters[worker] = stats
            if i == n // 2:  # mid-epoch: both workers are alive, with batches left
                tree = [main] + [p for p in child_pids(main) if p not in before]
                seen.update(tree)
                rss = sum(status_kb(p, "VmRSS") for p in tree)
                anon = sum(status_kb(p, "RssAnon") for p in tree)
                pss = sum(status_kb(p, "Pss", "smaps_rollup") for p in tree)
                fds_workers = sum(count_fds(p) for p in tree[1:])
        rate = len(got) / (time.perf_counter() - t0)
        del batch_keys, cls, blobs  # the last batch: its shared memory is the loop's
        gc.collect()  # a finished iterator's pipes close when it is collected
        if sorted(got) != everything:
            raise AssertionError(f"epoch {epoch} did not deliver every sample exactly once")
        if not persistent:
            last = {}
        evictions = sum(
            c["evictions"] - last.get(w, {}).get("evictions", 0) for w, c in counters.items()
        )
        downloaded = sum(
            c["bytes_downloaded"] - last.get(w, {}).get("bytes_downloaded", 0)
            for w, c in counters.items()
        )
        last = {w: dict(c) for w, c in counters.items()}
        tree_now = [main] + [p for p in child_pids(main) if p not in before]
        yield Sample(
            epoch=epoch,
            rss_main_kb=status_kb(main, "VmRSS"),
            rss_tree_kb=rss,
            anon_tree_kb=anon,
            pss_tree_kb=pss,
            fds_main=count_fds(main),
            fds_workers=fds_workers,
            shm=shm_entries(seen),
            temp=count_files(temp) + count_files(cache / "tmp") + count_files(cache, ".tmp"),
            locks=count_files(cache, ".lock"),
            held=held_deleted(tree_now, cache),
            evictions=evictions,
            downloaded_mb=downloaded / 1e6,
            rate=rate,
        )


def growth_kb(samples: Sequence[Sample], name: str) -> int:
    """Growth of memory field ``name`` from the start (epochs 1-2) to the end (the last two):
    the lower of each pair, so that one mid-epoch sample caught during a download (a fill
    buffer, a batch in flight) is not read as a trend; a leak raises both of the last two."""
    start = min(getattr(s, name) for s in samples[1:3])
    return int(min(getattr(s, name) for s in samples[-2:]) - start)


def flat_problems(samples: Sequence[Sample], *, temp: int) -> list[str]:
    """What is not flat between epoch 1 and the last (empty when all is); ``temp`` is the expected
    count of temp files (each live persistent worker keeps one multiprocessing socket)."""
    first, final = samples[1], samples[-1]
    problems = [
        f"{name} {getattr(first, name)} -> {getattr(final, name)}"
        for name in ("fds_main", "shm", "temp", "locks")
        if getattr(first, name) != getattr(final, name)
    ]
    if final.temp != temp:
        problems.append(f"temp files {final.temp} (expected {temp})")
    if any(s.held for s in samples):
        problems.append(f"evicted files held: {[s.held for s in samples]}")
    for name in ("anon_tree_kb", "rss_main_kb"):
        growth = growth_kb(samples, name)
        if growth >= RSS_GROWTH_KB:
            problems.append(f"{name} grew {growth / 1024:.1f} MB (bound {RSS_GROWTH_KB // 1024})")
    if any(s.evictions == 0 for s in samples[1:]):
        problems.append("an epoch without evictions: the cache is not smaller than the data")
    return problems


def table(samples: Sequence[Sample]) -> str:
    """The per-epoch table."""
    head = (
        f"{'epoch':>5} {'main':>6} {'rss MB':>7} {'anon':>6} {'pss MB':>7} {'fds':>4} {'wfds':>5} {'shm':>4} {'temp':>5} "
        f"{'locks':>5} {'held':>4} {'evict':>5} {'dl MB':>6} {'rate/s':>7}"
    )
    rows = [
        f"{s.epoch:>5} {s.rss_main_kb / 1024:>6.1f} {s.rss_tree_kb / 1024:>7.1f} "
        f"{s.anon_tree_kb / 1024:>6.1f} {s.pss_tree_kb / 1024:>7.1f} {s.fds_main:>4} "
        f"{s.fds_workers:>5} {s.shm:>4} {s.temp:>5} {s.locks:>5} {s.held:>4} {s.evictions:>5} "
        f"{s.downloaded_mb:>6.1f} {s.rate:>7.0f}"
        for s in samples
    ]
    return "\n".join([head, *rows])


# ---- main ---------------------------------------------------------------------------------------


def run_mode(
    url: str, options: dict[str, Any], args: argparse.Namespace, persistent: bool
) -> list[Sample]:
    """One soak of ``args.epochs`` epochs in this process, with a fresh cache and temp dir."""
    import fastload

    work = Path(tempfile.mkdtemp(prefix="fastload-soak-"))
    temp = work / "tmp"
    temp.mkdir()
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = str(temp), str(temp)  # the workers fork with it
    try:
        ds = fastload.open_dataset(
            url,
            cache_dir=work / "cache",
            cache_size=args.cache_bytes,
            seed=3,
            block_size=None,  # the streaming shuffle, for a cache smaller than the dataset
            window=2,
            prefetch_shards=1,
            fields=("__key__", "cls", "bin"),
            store_options=options,
        )
        loader = fastload.DataLoader(
            ds,
            batch_size=BATCH,
            num_workers=WORKERS,
            collate_fn=SoakCollate(),
            persistent_workers=persistent,
        )
        keys = [key_of(s, p) for s in range(args.shards) for p in range(args.per_shard)]
        samples: list[Sample] = []
        for sample in soak(loader, work / "cache", temp, args.epochs, keys, args.payload):
            samples.append(sample)
            print(f"  epoch {sample.epoch:2d}: {sample.rate:6.0f} samples/s", flush=True)
        del loader
        gc.collect()
        return samples
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[1]
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak in both worker modes; print the tables; exit 1 if anything is not flat."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="6 epochs of a 3 MB corpus")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per mode (default 20)")
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument("--per-shard", type=int, default=32)
    parser.add_argument("--payload", type=int, default=32768, help="bytes of `bin` per sample")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    args.epochs = args.epochs or (6 if args.quick else 20)
    args.shards = args.shards or (6 if args.quick else 32)
    data_bytes = args.shards * args.per_shard * (args.payload + 2048)
    args.cache_bytes = data_bytes // 3

    from fastload.testing.ceph import acquire, release

    cluster = acquire()
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    failed = False
    try:
        options = cluster.store_options()
        client = cluster.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/soak-{args.shards}x{args.per_shard}x{args.payload}"
        import fastload
        from fastload.errors import ObjectNotFoundError

        try:
            fastload.open_dataset(url, store_options=options)
        except (ObjectNotFoundError, FileNotFoundError):
            write_corpus(url, options, args.shards, args.per_shard, args.payload)
        print(
            f"soak: {args.epochs} epochs of {args.shards} x {args.per_shard} samples of "
            f"{args.payload} B (~{data_bytes / 1e6:.0f} MB) from {url} at {cluster.endpoint_url}, "
            f"cache {args.cache_bytes / 1e6:.1f} MB, {WORKERS} workers, batch {BATCH}",
            flush=True,
        )
        for persistent in (False, True):
            mode = "persistent workers" if persistent else "workers per epoch"
            print(f"\n{mode}:", flush=True)
            samples = run_mode(url, options, args, persistent)
            problems = flat_problems(samples, temp=WORKERS if persistent else 0)
            print(table(samples))
            print(("PASS" if not problems else "FAIL: " + "; ".join(problems)) + f" ({mode})")
            failed = failed or bool(problems)
            report[mode] = {"samples": [asdict(s) for s in samples], "problems": problems}
    finally:
        release(cluster)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
