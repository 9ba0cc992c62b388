"""One rank of a training job under a real launcher (``mpirun``, ``srun``, ``horovodrun``): the
loader finds its place only from the launcher's variables (no ``rank=``, no ``torch.distributed``).

Run by the launcher, once per process::

    mpirun -n 3 python -m fastload.testing.launchers --data DIR --log-dir LOG --epochs 0,1

Each process appends to ``LOG/rank-<rank>.jsonl``: one ``{"launch": ...}`` record (what
:func:`fastload.loader.detect_launch` found: rank, world size, local rank and size, source), then
one ``{"epoch", "step", "rank", "keys"}`` record per batch, then ``{"done": true, "stats": ...}``.
``--save-at E:S`` makes rank 0 write the loader state after step ``S`` of epoch ``E`` to
``LOG/state.json`` and every rank stop there (a job that ends at a checkpoint); ``--resume FILE``
loads a state first (with any world size of the same global batch). ``--probe`` records only the
launch (or the error refusing it) in ``LOG/probe-<pid>.json`` and exits 0.

:func:`write_dataset` writes the WebDataset the job reads; :func:`delivered` reads the logs back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["delivered", "key_of", "main", "write_dataset"]


def key_of(shard: int, position: int) -> str:
    """The key of sample ``position`` of shard ``shard``."""
    return f"s{shard:03d}/k{position:05d}"


def write_dataset(root: Path, sizes: Sequence[int]) -> list[str]:
    """A local WebDataset (indexes, manifest) with shards of ``sizes`` samples; its sorted keys."""
    from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
    from fastload.storage import LocalStore

    store = LocalStore(root)
    fmt = get_format("webdataset")
    entries = []
    for s, n in enumerate(sizes):
        writer = fmt.writer(store, f"train-{s:06d}.{fmt.extension}")
        for p in range(n):
            writer.write({"__key__": key_of(s, p), "cls": s * 1000 + p})
        entries.append(ShardEntry.from_info(writer.close()))
    write_manifest(store, Manifest(format=fmt.name, shards=entries))
    return sorted(key_of(s, p) for s, n in enumerate(sizes) for p in range(n))


def delivered(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's records (``rank-<r>.jsonl``), by rank."""
    out = {}
    for path in sorted(log_dir.glob("rank-*.jsonl")):
        rank = int(path.stem.partition("-")[2])
        out[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastload.testing.launchers", description=__doc__)
    p.add_argument("--data", help="dataset directory")
    p.add_argument("--log-dir", required=True, type=Path)
    p.add_argument("--epochs", default="0", help="comma-separated epochs to run")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-at", help="E:S: rank 0 saves the state after step S of epoch E; stop")
    p.add_argument("--resume", type=Path, help="a state written by --save-at")
    p.add_argument("--probe", action="store_true", help="record the launch found, nothing else")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank of the job (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    from fastload.errors import LaunchEnvironmentError
    from fastload.loader import detect_launch

    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.probe:
        try:
            found: dict[str, Any] = dataclasses.asdict(detect_launch())
        except LaunchEnvironmentError as exc:
            found = {"error": type(exc).__name__, "message": str(exc)}
        (args.log_dir / f"probe-{os.getpid()}.json").write_text(json.dumps(found))
        return 0

    import fastload

    ds = fastload.open_dataset(args.data, seed=args.seed, fields=("__key__",))
    loader = fastload.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    launch = detect_launch()
    log = args.log_dir / f"rank-{loader.rank}.jsonl"
    _append(log, {"launch": dataclasses.asdict(launch), "pid": os.getpid()})
    if args.resume is not None:
        loader.load_state_dict(json.loads(args.resume.read_text()))
    save_at = tuple(int(x) for x in args.save_at.split(":")) if args.save_at else None
    for epoch in (int(e) for e in args.epochs.split(",")):
        loader.set_epoch(epoch)
        step = loader.state_dict()["step"]
        for (keys,) in loader:
            _append(log, {"epoch": epoch, "step": step, "rank": loader.rank, "keys": list(keys)})
            step += 1
            if save_at == (epoch, step):
                if loader.rank == 0:
                    tmp = args.log_dir / "state.json.tmp"
                    tmp.write_text(json.dumps(loader.state_dict()))
                    os.replace(tmp, args.log_dir / "state.json")
                _append(log, {"done": True, "stats": loader.stats()})
                return 0
    _append(log, {"done": True, "stats": loader.stats()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
