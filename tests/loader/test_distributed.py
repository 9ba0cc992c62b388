"""Two real ranks in a gloo process group: rank detection, equal lengths, disjoint exactly-once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

CHILD = textwrap.dedent(
    """
    import datetime, json, sys
    import torch.distributed as dist
    import fastload.loader as fl

    rank, world, init, data, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    ds = fl.open_dataset(data, seed=7, decode="rgb8", fields=("__key__",))
    loader = fl.DataLoader(ds, batch_size=3, num_workers=1)
    result = {"rank": loader.rank, "world": loader.world_size, "len": len(loader), "epochs": []}
    for epoch in range(2):
        loader.set_epoch(epoch)
        keys = []
        for (batch_keys,) in loader:
            keys.append(list(batch_keys))
            dist.barrier()  # a collective per step, as DDP does: hangs if counts differ
        result["epochs"].append(keys)
    counts = [None, None]
    dist.all_gather_object(counts, [len(e) for e in result["epochs"]])
    result["all_counts"] = counts
    result["stats"] = loader.stats()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
    """
)


@pytest.mark.timeout(120)
def test_gloo_two_ranks(fake: SimpleNamespace, tmp_path: Path) -> None:
    sizes = [7, 0, 4, 6]  # 17 samples: padded to 18, last global step split 2 x 1 ... etc.
    data = fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset")
    init = f"file://{tmp_path / 'pg'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(r), init, data, str(tmp_path / f"out{r}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "CI": "", "OMP_NUM_THREADS": "1"},
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=100)
            logs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    results = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    assert results[0]["len"] == results[1]["len"] == 3  # ceil(17 / 6)
    assert results[0]["all_counts"] == [[3, 3], [3, 3]]
    everything = sorted(fake.all_keys(sizes))
    for epoch in range(2):
        per_rank = [[k for b in r["epochs"][epoch] for k in b] for r in results]
        union = per_rank[0] + per_rank[1]
        assert sorted(set(union)) == everything  # every sample ...
        assert len(union) == 18  # ... once, plus one repeat (padding to a multiple of 2)
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
    assert sum(r["stats"]["padded"] for r in results) == 2  # one per epoch
