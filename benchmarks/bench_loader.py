"""Loader benchmark on the W1 corpus: fastload against its peers, side by side in one run.

Two workloads, 2 loader workers each (see issue 5 and /work/shared/BENCHMARKS.md):

* **bytes**: raw JPEG bytes + integer label, batch 256, shuffled. fastload delivers the bytes as
  its default :class:`~fastload.loader.PackedBytes` (one shared-memory buffer per batch);
  ``fastload-list`` collates them into a list of ``bytes`` like the peers. Peers: a plain
  ``torch.utils.data.DataLoader`` over the loose files (the baseline), the webdataset library over
  the same tar shards fastload reads, litdata and mosaicml-streaming (optional, from
  ``.venv-bench``). Reference: the warm page-cache read bandwidth of the same shard bytes.
* **train**: decode + random-resized-crop 224 + horizontal flip + normalize to float, batch 64.
  Peers: torch DataLoader + PIL over the loose files, webdataset + PIL, litdata/mosaicml + PIL
  (optional), and the DALI CPU pipeline with fused crop-while-decoding
  (``fn.decoders.image_random_crop`` over ``fn.readers.file``, 2 threads) as the reference.
  Reference: the single-core decode+augment rate of fastload's fused transform, x 2 (the 2-core
  limit), measured in the same run.

Every measurement runs in a fresh subprocess; loaders alternate round by round (this machine is
shared and varies); the report gives medians and ratios, and the CPU time per sample of the
loader process plus its workers (steadier than wall time when other jobs share the cores). Data are in the warm page cache (each
child reads its data once before timing). Throughput is counted from the end of the warm-up
batches to the last batch, so worker start-up is excluded for every loader alike.

Run: ``.venv/bin/python -m benchmarks.bench_loader [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import (
    PEERS_PYTHON,
    REPO,
    Table,
    alternating,
    dali_batches,
    emit_result,
    fmt_ratio,
    median_rate,
    ok_runs,
    print_round,
    ratio,
    run_child,
    time_batches,
    warm,
)
from benchmarks.corpus import DEFAULT_ROOT, Corpus, FileBytes, ensure_corpus

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
WORKERS = 2
#: Loader kinds that run in the peers' interpreter (they do not install beside fastload).
PEER_KINDS = frozenset({"litdata", "mosaic"})
#: The train workload's peers that decode with PIL ("vs best PIL peer").
PIL_PEERS = ("torch", "webdataset", "litdata", "mosaic")

# ---------------------------------------------------------------------------------------------
# Shared pieces used inside the child processes (module level so that workers can pickle them)
# ---------------------------------------------------------------------------------------------


def pil_train(data: bytes, rng: np.random.Generator | None = None) -> Any:
    """The usual PIL training transform (what torchvision's RandomResizedCrop + flip + ToTensor +
    Normalize do in PIL mode): decode, crop, resize bilinear, flip, float CHW normalized."""
    import torch
    from PIL import Image

    from fastload.loader.transforms import random_resized_crop_box

    rng = rng if rng is not None else np.random.default_rng()
    img = Image.open(io.BytesIO(data)).convert("RGB")
    top, left, h, w = random_resized_crop_box(img.height, img.width, rng)
    img = img.crop((left, top, left + w, top + h)).resize((224, 224), Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div_(255.0)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return (t - mean) / std


class FileTrain(FileBytes):
    """Loose files + :func:`pil_train`: ``(float CHW tensor, label)``."""

    def __getitem__(self, i: int) -> tuple[Any, int]:  # type: ignore[override]
        data, label = super().__getitem__(i)
        return pil_train(data), label


def bytes_as_list(samples: list[tuple[bytes, int]]) -> tuple[list[bytes], Any]:
    """Collate ``(bytes, label)`` samples into a list of ``bytes`` + labels: what fastload's
    default collation gave before byte fields became one :class:`~fastload.loader.PackedBytes`
    buffer (each ``bytes`` object is then pickled through the worker's pipe, as with the peers)."""
    import torch

    return [s[0] for s in samples], torch.tensor([s[1] for s in samples], dtype=torch.int64)


def _as_workload(data: bytes, label: Any, workload: str) -> tuple[Any, int]:
    """A peer's sample as the workload wants it: ``(bytes, label)`` for ``bytes``, else
    ``(pil_train(bytes), label)``."""
    return (data if workload == "bytes" else pil_train(data)), int(label)


def _wds_label(sample: dict[str, Any]) -> tuple[bytes, int]:
    return sample["jpg"], int(sample["cls"])


def _wds_train(sample: dict[str, Any]) -> tuple[Any, int]:
    return pil_train(sample["jpg"]), int(sample["cls"])


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process (all threads), its live child processes (loader
    workers) and its reaped children. Differences of it are the loader's whole CPU cost, which
    varies much less than wall time on a shared machine."""
    total = time.process_time()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    total += ru.ru_utime + ru.ru_stime
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # fields[1] is the parent pid; [11], [12] utime, stime
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


# ---------------------------------------------------------------------------------------------
# Children: one loader measurement each
# ---------------------------------------------------------------------------------------------


def _measure(batches: Iterable[Any], cfg: dict[str, Any]) -> dict[str, float]:
    """Time ``batches`` up to ``cfg["limit"]`` samples (see :func:`time_batches`), CPU time of
    this process and its workers included; this process's torch runs on one thread (the
    loader's workers or threads do the work)."""
    import torch

    torch.set_num_threads(1)
    return time_batches(batches, cfg["limit"], cpu_clock=_cpu_seconds)


def _shards(cfg: dict[str, Any]) -> list[str]:
    root = Path(cfg["wds"])
    return sorted(str(p) for p in root.glob("*.tar"))


def child_pagecache(cfg: dict[str, Any]) -> dict[str, float]:
    paths = _shards(cfg)
    warm(paths)
    t0 = time.perf_counter()
    total = warm(paths)
    dt = time.perf_counter() - t0
    return {"bytes": total, "seconds": dt, "samples": cfg["count"]}


def child_fastload(cfg: dict[str, Any], workload: str, variant: str = "") -> dict[str, float]:
    import fastload.loader as fl
    from fastload.loader.decode import Decoder
    from fastload.loader.transforms import ImageTrainTransform

    warm(_shards(cfg))
    batch = cfg["batch"]
    collate: Callable[..., Any] | None = None
    finish: Callable[[Any], Any] | None = None
    if workload == "bytes":
        ds = fl.open_dataset(
            cfg["wds"], seed=0, decode=Decoder(image="bytes"), fields=("jpg", "cls")
        )
        if variant == "list":
            collate = bytes_as_list
    else:
        # The fused transform runs as the decoder: corrupt images then follow on_error.
        tf = ImageTrainTransform(normalize_on="sample" if variant == "float" else "batch")
        ds = fl.open_dataset(cfg["wds"], seed=0, decode=Decoder(image=tf), fields=("jpg", "cls"))
        finish = tf.batch_transform
    loader = fl.DataLoader(ds, batch_size=batch, num_workers=WORKERS, collate_fn=collate)

    def batches() -> Iterable[Any]:
        for batch in loader:
            if finish is not None:
                batch = (finish(batch[0]), batch[1])
            yield batch

    return _measure(batches(), cfg)


def child_torch(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    from torch.utils.data import DataLoader

    corpus = Corpus(Path(cfg["root"]), cfg["count"])
    files = corpus.files()
    warm(p for p, _ in files)
    ds = FileBytes(files) if workload == "bytes" else FileTrain(files)
    loader = DataLoader(ds, batch_size=cfg["batch"], shuffle=True, num_workers=WORKERS)
    return _measure(loader, cfg)


def child_webdataset(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import webdataset as wds

    shards = _shards(cfg)
    warm(shards)
    fn = _wds_label if workload == "bytes" else _wds_train
    ds = (
        wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False)
        .shuffle(1000)
        .map(fn)
        .batched(cfg["batch"], partial=True)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)
    return _measure(loader, cfg)


def child_litdata(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import litdata

    class LitDS(litdata.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            s = super().__getitem__(index)
            # litdata yields memoryviews, which workers cannot pickle
            return _as_workload(bytes(s["jpg"]), s["cls"], workload)

    warm(str(p) for p in Path(cfg["litdata"]).glob("*"))
    ds = LitDS(input_dir=cfg["litdata"], shuffle=True, seed=0)
    loader = litdata.StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS)
    return _measure(loader, cfg)


def child_mosaic(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import streaming
    from torch.utils.data import DataLoader

    class MdsDS(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            s = super().__getitem__(index)
            return _as_workload(s["jpg"], s["cls"], workload)

    warm(str(p) for p in Path(cfg["mds"]).glob("*"))
    streaming.base.util.clean_stale_shared_memory()
    ds = MdsDS(local=cfg["mds"], shuffle=True, shuffle_seed=0, batch_size=cfg["batch"])
    loader = DataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS)
    return _measure(loader, cfg)


def child_dali(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    from nvidia.dali import fn, pipeline_def, types

    root = cfg["folder"]
    warm(str(p) for p in Path(root).rglob("*.jpg"))
    batch = cfg["batch"]

    @pipeline_def(batch_size=batch, num_threads=WORKERS, device_id=None, seed=0)  # type: ignore[misc]
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
        )
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[m * 255 for m in MEAN],
            std=[s * 255 for s in STD],
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels

    p = pipe()
    p.build()
    return _measure(dali_batches(p), cfg)


def child_single_core(cfg: dict[str, Any], workload: str, variant: str = "") -> dict[str, float]:
    """One core, no loader: fused fastload transform (uint8 + batch normalize), the PIL baseline,
    or bare JPEG decoding with PIL / simplejpeg."""
    import simplejpeg
    import torch
    from PIL import Image

    from fastload.loader.transforms import ImageTrainTransform, sample_rng

    torch.set_num_threads(1)
    files = Corpus(Path(cfg["root"]), cfg["count"]).files()[: cfg["single_n"]]
    datas = [Path(p).read_bytes() for p, _ in files]
    tf = ImageTrainTransform()
    fns: dict[str, Callable[[bytes, int], Any]] = {
        "fused": lambda d, i: tf(d, sample_rng(0, 0, i)),
        "fused-float": lambda d, i: ImageTrainTransform(normalize_on="sample")(
            d, sample_rng(0, 0, i)
        ),
        "pil": lambda d, i: pil_train(d, sample_rng(0, 0, i)),
        "decode-pil": lambda d, i: Image.open(io.BytesIO(d)).convert("RGB"),
        "decode-simplejpeg": lambda d, i: simplejpeg.decode_jpeg(d, colorspace="RGB"),
    }
    fn = fns[variant]
    for i, d in enumerate(datas[:20]):
        fn(d, i)
    t0 = time.perf_counter()
    out = []
    for i, d in enumerate(datas):
        out.append(fn(d, i))
        if variant == "fused" and len(out) == 64:
            tf.batch_transform(torch.stack(out))
            out = []
    dt = time.perf_counter() - t0
    return {"samples": len(datas), "seconds": dt}


def _dali_single(batch: int) -> Callable[[list[bytes]], Any]:
    """DALI CPU fused crop-decode + resize + flip + normalize with one thread, fed the same bytes."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, seed=0, prefetch_queue_depth=1)  # type: ignore[misc]
    def pipe() -> Any:
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
        )
        images = fn.resize(images, resize_x=224, resize_y=224)
        return fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[m * 255 for m in MEAN],
            std=[s * 255 for s in STD],
            mirror=fn.random.coin_flip(probability=0.5),
        )

    p = pipe()
    p.build()

    def run(datas: list[bytes]) -> Any:
        p.feed_input("jpegs", [np.frombuffer(d, np.uint8) for d in datas])
        (out,) = p.run()
        return np.array(out.as_tensor())

    return run


def transforms_comparison(cfg: dict[str, Any], blocks: int) -> dict[str, float]:
    """Single-core rates of decoders and train transforms, interleaved block by block in one
    process so that load changes on a shared machine hit every variant alike."""
    import simplejpeg
    import torch
    from PIL import Image

    from fastload.loader.transforms import ImageTrainTransform, sample_rng

    torch.set_num_threads(1)
    files = Corpus(Path(cfg["root"]), cfg["count"]).files()
    block = 32
    datas = [Path(p).read_bytes() for p, _ in files[: block * blocks]]
    fused = ImageTrainTransform()
    fused_float = ImageTrainTransform(normalize_on="sample")
    fused_nodct = ImageTrainTransform(dct_scaling=False)

    def per_image(fn: Callable[[bytes, int], Any]) -> Callable[[list[bytes], int], Any]:
        return lambda ds, base: [fn(d, base + i) for i, d in enumerate(ds)]

    def fused_batch(ds: list[bytes], base: int) -> Any:
        return fused.batch_transform(
            torch.stack([fused(d, sample_rng(0, 0, base + i)) for i, d in enumerate(ds)])
        )

    def nodct_batch(ds: list[bytes], base: int) -> Any:
        return fused_nodct.batch_transform(
            torch.stack([fused_nodct(d, sample_rng(0, 0, base + i)) for i, d in enumerate(ds)])
        )

    variants: dict[str, Callable[[list[bytes], int], Any]] = {
        "decode-pil": per_image(lambda d, i: Image.open(io.BytesIO(d)).convert("RGB")),
        "decode-simplejpeg": per_image(lambda d, i: simplejpeg.decode_jpeg(d, colorspace="RGB")),
        "pil-rrc-float": per_image(lambda d, i: pil_train(d, sample_rng(0, 0, i))),
        "fused-uint8+batch-normalize": fused_batch,
        "fused-uint8-no-dct-scaling": nodct_batch,
        "fused-float-per-sample": per_image(lambda d, i: fused_float(d, sample_rng(0, 0, i))),
    }
    try:
        variants["dali-1-thread"] = (lambda run: lambda ds, base: run(ds))(_dali_single(block))
    except ImportError:
        pass
    spent = dict.fromkeys(variants, 0.0)
    for k in range(blocks):
        chunk = datas[k * block : (k + 1) * block]
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(chunk, k * block)
            spent[name] += time.perf_counter() - t0
    return {name: len(datas) / t for name, t in spent.items()}


CHILDREN: dict[str, Callable[..., dict[str, float]]] = {
    "pagecache": child_pagecache,
    "fastload": child_fastload,
    "torch": child_torch,
    "webdataset": child_webdataset,
    "litdata": child_litdata,
    "mosaic": child_mosaic,
    "dali": child_dali,
    "single": child_single_core,
}

# ---------------------------------------------------------------------------------------------
# Parent: preparation, alternating rounds, report
# ---------------------------------------------------------------------------------------------


_PREP_MDS = """
import sys
from pathlib import Path
from streaming import MDSWriter
from benchmarks.corpus import Corpus

root, count, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit="64mb") as w:
    for path, label in Corpus(Path(root), count).files():
        w.write({"jpg": Path(path).read_bytes(), "cls": label})
"""


def _lit_item(entry: tuple[str, int]) -> dict[str, Any]:
    """litdata ``optimize`` item function (module level, so its worker processes can import it)."""
    path, label = entry
    return {"jpg": Path(path).read_bytes(), "cls": label}


def prep_litdata(root: str, count: int, out: str) -> None:
    """Write the corpus with ``litdata.optimize`` (runs in .venv-bench)."""
    import litdata

    files = Corpus(Path(root), count).files()
    litdata.optimize(fn=_lit_item, inputs=files, output_dir=out, chunk_bytes="64MB", num_workers=2)
    index = json.loads((Path(out) / "index.json").read_text())
    if not index.get("chunks"):  # litdata can exit 0 having written nothing
        raise RuntimeError(f"litdata.optimize wrote no chunks to {out}")


def _prepare_peer(kind: str, corpus: Corpus) -> tuple[Path | None, str]:
    """Convert the corpus for litdata / mosaicml-streaming in .venv-bench; (path, why not)."""
    if not Path(PEERS_PYTHON).exists():
        return None, f"{PEERS_PYTHON} missing: build it with tools/bench-env.sh"
    dst = corpus.root.parent / f"{corpus.root.name}-{kind}-{corpus.count}"
    done = dst.parent / f".{dst.name}.complete"
    if done.exists():
        return dst, ""
    if kind == "litdata":
        cmd = [PEERS_PYTHON, "-m", "benchmarks.bench_loader", "--prep-litdata"]
    else:
        cmd = [PEERS_PYTHON, "-c", _PREP_MDS]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*cmd, str(corpus.root), str(corpus.count), str(dst)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    if proc.returncode != 0:
        return None, f"{kind} conversion failed: {proc.stderr.strip().splitlines()[-1:]}"
    done.write_text("ok")
    print(f"prepared {kind} in {time.perf_counter() - t0:.1f} s: {dst}")
    return dst, ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload loader benchmark (W1 images)")
    parser.add_argument("--quick", action="store_true", help="small corpus, 2 rounds (< 2 min)")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--count", type=int, help="corpus images (default 10000, quick 2000)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 2)")
    parser.add_argument("--workloads", default="bytes,train")
    parser.add_argument("--loaders", default="", help="comma-separated subset of loaders")
    parser.add_argument("--root", default=None, help=f"corpus cache (default {DEFAULT_ROOT})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prep-litdata", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--transforms",
        action="store_true",
        help="only compare decoders and train transforms on one core, interleaved",
    )
    args = parser.parse_args(argv)

    if args.prep_litdata:
        root, n, out = args.prep_litdata
        prep_litdata(root, int(n), out)
        return 0

    if args.child:
        spec = json.loads(args.child)
        fn = CHILDREN[spec["kind"]]
        kwargs = {k: spec[k] for k in ("workload", "variant") if spec.get(k)}
        emit_result(fn(spec["cfg"], **kwargs))
        return 0

    quick = args.quick
    count = args.count or (2000 if quick else 10_000)
    rounds = args.rounds or (2 if quick else 3)
    corpus = ensure_corpus(count, None if args.root is None else Path(args.root) / "w1")
    if args.transforms:
        rates = transforms_comparison(
            {"root": str(corpus.root), "count": count}, 6 if quick else 20
        )
        base = rates["pil-rrc-float"]
        table = Table(("single core, interleaved", 30), ("img/s", 7), ("vs PIL RRC", 10))
        print(table.header())
        for name, rate in rates.items():
            print(table.row(name, f"{rate:.0f}", fmt_ratio(rate / base)))
        if args.json:
            Path(args.json).write_text(json.dumps({"single_core": rates}, indent=2))
        return 0
    folder = corpus.folder()
    nbytes = corpus.total_bytes()
    mean_kb = nbytes / count / 1e3
    print(f"corpus: {count} JPEGs, {nbytes / 1e6:.0f} MB, mean {mean_kb:.1f} KB at {folder}")
    wds_dir = corpus.webdataset(shards=16, workers=WORKERS)
    cfg: dict[str, Any] = {
        "root": str(corpus.root),
        "folder": str(folder),
        "count": count,
        "wds": str(wds_dir),
        "single_n": 128 if quick else 600,
    }
    skipped: dict[str, str] = {}
    for kind, prepared in (("litdata", "litdata"), ("mosaic", "mds")):
        path, why = _prepare_peer(prepared, corpus)
        if path is None:
            skipped[kind] = why
            print(f"skipping {kind}: {why}")
        else:
            cfg[prepared] = str(path)

    try:
        import nvidia.dali  # noqa: F401
    except ImportError as exc:
        skipped["dali"] = f"nvidia-dali not importable: {exc}"

    workloads = [w for w in args.workloads.split(",") if w]
    want = {x for x in args.loaders.split(",") if x}
    plans: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    if "bytes" in workloads:
        b = {**cfg, "batch": 256, "limit": count}
        plans["bytes"] = [
            ("pagecache", {"kind": "pagecache", "cfg": b}),
            ("fastload", {"kind": "fastload", "workload": "bytes", "cfg": b}),
            (
                "fastload-list",
                {"kind": "fastload", "workload": "bytes", "variant": "list", "cfg": b},
            ),
            ("torch", {"kind": "torch", "workload": "bytes", "cfg": b}),
            ("webdataset", {"kind": "webdataset", "workload": "bytes", "cfg": b}),
            ("litdata", {"kind": "litdata", "workload": "bytes", "cfg": b}),
            ("mosaic", {"kind": "mosaic", "workload": "bytes", "cfg": b}),
        ]
    if "train" in workloads:
        t = {**cfg, "batch": 64, "limit": 512 if quick else min(count, 4096)}
        plans["train"] = [
            ("single-fused", {"kind": "single", "workload": "train", "variant": "fused", "cfg": t}),
            ("single-pil", {"kind": "single", "workload": "train", "variant": "pil", "cfg": t}),
            ("fastload", {"kind": "fastload", "workload": "train", "cfg": t}),
            (
                "fastload-float",
                {"kind": "fastload", "workload": "train", "variant": "float", "cfg": t},
            ),
            ("dali", {"kind": "dali", "workload": "train", "cfg": t}),
            ("torch", {"kind": "torch", "workload": "train", "cfg": t}),
            ("webdataset", {"kind": "webdataset", "workload": "train", "cfg": t}),
            ("litdata", {"kind": "litdata", "workload": "train", "cfg": t}),
            ("mosaic", {"kind": "mosaic", "workload": "train", "cfg": t}),
        ]
        if not quick:
            for v in ("decode-pil", "decode-simplejpeg", "fused-float"):
                plans["train"].insert(
                    2,
                    (
                        f"single-{v}",
                        {"kind": "single", "workload": "train", "variant": v, "cfg": t},
                    ),
                )
    runs = [
        (workload, name, spec)
        for workload, plan in plans.items()
        for name, spec in plan
        if (not want or name in want or spec["kind"] in want) and spec["kind"] not in skipped
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in plans}
    t_start = time.perf_counter()
    for r, (workload, name, spec) in alternating(runs, rounds):
        python = PEERS_PYTHON if spec["kind"] in PEER_KINDS else sys.executable
        res = run_child(
            [python, "-m", "benchmarks.bench_loader", "--child", json.dumps(spec)], timeout=600
        )
        results[workload].setdefault(name, []).append(res)
        print_round(r, f"{workload:5s} {name:22s}", res)
    report = _report(results, mean_kb, skipped)
    report["config"] = {"count": count, "rounds": rounds, "workers": WORKERS, "quick": quick}
    report["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _median_cpu_us(runs: list[dict[str, Any]]) -> float | None:
    """Median CPU microseconds per sample (loader process + workers), where measured."""
    ok = [
        r["cpu_seconds"] / r["samples"] * 1e6
        for r in ok_runs(runs)
        if r.get("cpu_seconds") and r["samples"] > 0
    ]
    return statistics.median(ok) if ok else None


def _cpu_cells(cpu: float | None, best_peer_cpu: float | None, ours: bool) -> tuple[str, str]:
    """``CPU us/sample`` and, for fastload rows, the peer's CPU per sample over ours."""
    if cpu is None:
        return "-", ""
    return f"{cpu:.0f}", fmt_ratio(ratio(best_peer_cpu, cpu)) if ours and best_peer_cpu else ""


_BYTES_TABLE = Table(
    ("loader", 22),
    ("samples/s", 10),
    ("MB/s", 8),
    ("vs torch", 9),
    ("vs best peer", 12),
    ("of page cache", 13),
    ("CPU us/s.", 9),
    ("CPU gain", 8),
)
_TRAIN_TABLE = Table(
    ("loader", 22),
    ("img/s", 8),
    ("vs DALI", 8),
    ("vs best PIL peer", 16),
    ("of 2-core limit", 15),
    ("CPU us/img", 9),
    ("DALI/ours", 8),
)


def _bytes_table(
    by_name: dict[str, list[dict[str, Any]]],
    rates: dict[str, float | None],
    cpus: dict[str, float | None],
    errors: dict[str, str],
    mean_kb: float,
) -> float | None:
    """Print the bytes workload's table; return the page cache's read bandwidth (bytes/s)."""
    bw = median_rate(by_name.get("pagecache", []), "bytes")
    peers = [k for k in rates if not k.startswith(("fastload", "pagecache"))]
    best_peer = max((v for k in peers if (v := rates[k])), default=None)
    best_cpu = min((v for k in peers if (v := cpus[k])), default=None)
    base = rates.get("torch")
    print(_BYTES_TABLE.header())
    if bw:
        print(
            _BYTES_TABLE.row("page cache (dd-like)", f"{bw / mean_kb / 1e3:.0f}", f"{bw / 1e6:.0f}")
        )
    for name, rate in rates.items():
        if name == "pagecache":
            continue
        if rate is None:
            print(_BYTES_TABLE.error(name, errors.get(name, "")))
            continue
        ours = name.startswith("fastload")
        mbs = rate * mean_kb / 1e3
        share = f"{mbs * 1e6 / bw * 100:.1f}%" if bw else "-"
        vs_peer = fmt_ratio(ratio(rate, best_peer) if ours else None)
        print(
            _BYTES_TABLE.row(
                name,
                f"{rate:.0f}",
                f"{mbs:.0f}",
                fmt_ratio(ratio(rate, base)),
                vs_peer,
                share,
                *_cpu_cells(cpus.get(name), best_cpu, ours),
            )
        )
    return bw


def _train_table(
    rates: dict[str, float | None], cpus: dict[str, float | None], errors: dict[str, str]
) -> float | None:
    """Print the train workload's table; return the 2-core limit (img/s)."""
    single = rates.get("single-fused")
    limit = 2 * single if single else None
    dali = rates.get("dali")
    best_peer = max((v for k in PIL_PEERS if (v := rates.get(k))), default=None)
    print(_TRAIN_TABLE.header())
    for name, rate in rates.items():
        if rate is None:
            print(_TRAIN_TABLE.error(name, errors.get(name, "")))
            continue
        if name.startswith("single"):
            print(_TRAIN_TABLE.row(name, f"{rate:.0f}") + "   (one core, no loader)")
            continue
        of_limit = f"{rate / limit * 100:.0f}%" if limit else "-"
        print(
            _TRAIN_TABLE.row(
                name,
                f"{rate:.0f}",
                fmt_ratio(ratio(rate, dali)),
                fmt_ratio(ratio(rate, best_peer)),
                of_limit,
                *_cpu_cells(cpus.get(name), cpus.get("dali"), name.startswith("fastload")),
            )
        )
    if limit:
        print(f"2-core limit (single-core fused x 2): {limit:.0f} img/s")
    return limit


def _report(
    results: dict[str, dict[str, list[dict[str, Any]]]], mean_kb: float, skipped: dict[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": skipped, "workloads": {}}
    for workload, by_name in results.items():
        rates = {name: median_rate(runs) for name, runs in by_name.items()}
        cpus = {name: _median_cpu_us(runs) for name, runs in by_name.items()}
        errors = {
            name: runs[-1].get("error", "") for name, runs in by_name.items() if rates[name] is None
        }
        print(f"\n== {workload} (medians of {max(len(r) for r in by_name.values())} rounds) ==")
        table: dict[str, Any] = {"rates": rates, "cpu_us_per_sample": cpus, "errors": errors}
        if workload == "bytes":
            table["pagecache_bytes_per_s"] = _bytes_table(by_name, rates, cpus, errors, mean_kb)
        else:
            table["two_core_limit"] = _train_table(rates, cpus, errors)
        out["workloads"][workload] = table
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return out


if __name__ == "__main__":
    sys.exit(main())
