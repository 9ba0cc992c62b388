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
import math
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

from benchmarks.corpus import DEFAULT_ROOT, Corpus, ensure_corpus

BENCH_VENV = Path(__file__).resolve().parent.parent / ".venv-bench" / "bin" / "python"
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
WORKERS = 2

# ---------------------------------------------------------------------------------------------
# Shared pieces used inside the child processes (module level so that workers can pickle them)
# ---------------------------------------------------------------------------------------------


class FileBytes:
    """Map-style dataset over loose files: ``(file bytes, label)``."""

    def __init__(self, files: Sequence[tuple[str, int]]) -> None:
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, label = self.files[i]
        with open(path, "rb") as f:
            return f.read(), label


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


def _wds_label(sample: dict[str, Any]) -> tuple[bytes, int]:
    return sample["jpg"], int(sample["cls"])


def _wds_train(sample: dict[str, Any]) -> tuple[Any, int]:
    return pil_train(sample["jpg"]), int(sample["cls"])


def _count(batch: Any) -> int:
    """Samples in a batch: the length of its label tensor (last element)."""
    labels = batch[-1] if isinstance(batch, (tuple, list)) else batch["cls"]
    return len(labels)


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


def _timed(batches: Iterable[Any], limit: int, warmup: int = 2) -> dict[str, float]:
    """Consume batches up to ``limit`` samples; rate and CPU time measured after ``warmup``
    batches (CPU: this process plus its workers)."""
    n = seen = 0
    t0 = time.perf_counter()
    cpu0 = _cpu_seconds()
    start, cpu_start = t0, cpu0
    counted = 0
    for batch in batches:
        size = _count(batch)
        seen += size
        n += 1
        if n == warmup:
            start = time.perf_counter()
            cpu_start = _cpu_seconds()
            counted = 0
        elif n > warmup:
            counted += size
        if seen >= limit:
            break
    end = time.perf_counter()
    cpu_end = _cpu_seconds()
    if n <= warmup:  # too few batches: count everything
        counted, start, cpu_start = seen, t0, cpu0
    return {
        "samples": counted,
        "seconds": end - start,
        "total_seconds": end - t0,
        "cpu_seconds": cpu_end - cpu_start,
    }


def _warm(paths: Iterable[str]) -> int:
    total = 0
    buf = bytearray(4 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


# ---------------------------------------------------------------------------------------------
# Children: one loader measurement each
# ---------------------------------------------------------------------------------------------


def _shards(cfg: dict[str, Any]) -> list[str]:
    root = Path(cfg["wds"])
    return sorted(str(p) for p in root.glob("*.tar"))


def child_pagecache(cfg: dict[str, Any]) -> dict[str, float]:
    paths = _shards(cfg)
    _warm(paths)
    t0 = time.perf_counter()
    total = _warm(paths)
    dt = time.perf_counter() - t0
    return {"bytes": total, "seconds": dt, "samples": cfg["count"]}


def child_fastload(cfg: dict[str, Any], workload: str, variant: str = "") -> dict[str, float]:
    import torch

    import fastload.loader as fl
    from fastload.loader.decode import Decoder
    from fastload.loader.transforms import ImageTrainTransform

    _warm(_shards(cfg))
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

    torch.set_num_threads(1)
    return _timed(batches(), cfg["limit"])


def child_torch(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import torch
    from torch.utils.data import DataLoader

    corpus = Corpus(Path(cfg["root"]), cfg["count"])
    files = corpus.files()
    _warm(p for p, _ in files)
    ds = FileBytes(files) if workload == "bytes" else FileTrain(files)
    loader = DataLoader(ds, batch_size=cfg["batch"], shuffle=True, num_workers=WORKERS)
    torch.set_num_threads(1)
    return _timed(loader, cfg["limit"])


def child_webdataset(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import torch
    import webdataset as wds

    shards = _shards(cfg)
    _warm(shards)
    fn = _wds_label if workload == "bytes" else _wds_train
    ds = (
        wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False)
        .shuffle(1000)
        .map(fn)
        .batched(cfg["batch"], partial=True)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)
    torch.set_num_threads(1)
    return _timed(loader, cfg["limit"])


def child_litdata(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import litdata
    import torch

    class LitDS(litdata.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            s = super().__getitem__(index)
            data = bytes(s["jpg"])  # litdata yields memoryviews, which workers cannot pickle
            return (data if workload == "bytes" else pil_train(data)), int(s["cls"])

    _warm(str(p) for p in Path(cfg["litdata"]).glob("*"))
    ds = LitDS(input_dir=cfg["litdata"], shuffle=True, seed=0)
    loader = litdata.StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS)
    torch.set_num_threads(1)
    return _timed(loader, cfg["limit"])


def child_mosaic(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import streaming
    import torch
    from torch.utils.data import DataLoader

    class MdsDS(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            s = super().__getitem__(index)
            data = s["jpg"]
            return (data if workload == "bytes" else pil_train(data)), int(s["cls"])

    _warm(str(p) for p in Path(cfg["mds"]).glob("*"))
    streaming.base.util.clean_stale_shared_memory()
    ds = MdsDS(local=cfg["mds"], shuffle=True, shuffle_seed=0, batch_size=cfg["batch"])
    loader = DataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS)
    torch.set_num_threads(1)
    return _timed(loader, cfg["limit"])


def child_dali(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import torch
    from nvidia.dali import fn, pipeline_def, types

    root = cfg["folder"]
    _warm(str(p) for p in Path(root).rglob("*.jpg"))
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

    def batches() -> Iterable[Any]:
        while True:
            images, labels = p.run()
            yield (
                torch.from_numpy(np.array(images.as_tensor())),
                torch.from_numpy(np.array(labels.as_tensor())).view(-1),
            )

    torch.set_num_threads(1)
    return _timed(batches(), cfg["limit"])


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


def _prepare_fastload(corpus: Corpus, folder: Path, shards: int) -> Path:
    from fastload.convert import convert

    dst = corpus.root.parent / f"{corpus.root.name}-wds-{corpus.count}"
    if not (dst / "fastload.json").exists():
        t0 = time.perf_counter()
        convert(
            str(folder),
            str(dst),
            format="webdataset",
            shard_samples=math.ceil(corpus.count / shards),
            workers=WORKERS,
            quiet=True,
        )
        print(f"prepared fastload webdataset shards in {time.perf_counter() - t0:.1f} s: {dst}")
    return dst


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
    if not BENCH_VENV.exists():
        return None, f"{BENCH_VENV} missing (see BENCHMARKS.md for how to build it)"
    dst = corpus.root.parent / f"{corpus.root.name}-{kind}-{corpus.count}"
    done = dst.parent / f".{dst.name}.complete"
    if done.exists():
        return dst, ""
    if kind == "litdata":
        cmd = [str(BENCH_VENV), "-m", "benchmarks.bench_loader", "--prep-litdata"]
    else:
        cmd = [str(BENCH_VENV), "-c", _PREP_MDS]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*cmd, str(corpus.root), str(corpus.count), str(dst)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=900,
    )
    if proc.returncode != 0:
        return None, f"{kind} conversion failed: {proc.stderr.strip().splitlines()[-1:]}"
    done.write_text("ok")
    print(f"prepared {kind} in {time.perf_counter() - t0:.1f} s: {dst}")
    return dst, ""


def _run_child(spec: dict[str, Any], python: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [python, "-m", "benchmarks.bench_loader", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


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
        result = fn(spec["cfg"], **kwargs)
        print("RESULT " + json.dumps(result), flush=True)
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
        print(f"{'single core, interleaved':30s} {'img/s':>7s} {'vs PIL RRC':>10s}")
        for name, rate in rates.items():
            print(f"{name:30s} {rate:7.0f} {rate / base:9.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps({"single_core": rates}, indent=2))
        return 0
    folder = corpus.folder()
    nbytes = corpus.total_bytes()
    mean_kb = nbytes / count / 1e3
    print(f"corpus: {count} JPEGs, {nbytes / 1e6:.0f} MB, mean {mean_kb:.1f} KB at {folder}")
    wds_dir = _prepare_fastload(corpus, folder, shards=16)
    cfg: dict[str, Any] = {
        "root": str(corpus.root),
        "folder": str(folder),
        "count": count,
        "wds": str(wds_dir),
        "single_n": 128 if quick else 600,
    }
    skipped: dict[str, str] = {}
    peers_python: dict[str, str] = {}
    for kind in ("litdata", "mosaic"):
        path, why = _prepare_peer("litdata" if kind == "litdata" else "mds", corpus)
        if path is None:
            skipped[kind] = why
            print(f"skipping {kind}: {why}")
        else:
            cfg["litdata" if kind == "litdata" else "mds"] = str(path)
            peers_python[kind] = str(BENCH_VENV)

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
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in plans}
    t_start = time.perf_counter()
    for r in range(rounds):
        for workload, plan in plans.items():
            for name, spec in plan:
                kind = spec["kind"]
                if want and name not in want and kind not in want:
                    continue
                if kind in skipped:
                    continue
                python = peers_python.get(kind, sys.executable)
                try:
                    res = _run_child(spec, python, timeout=600)
                except subprocess.TimeoutExpired:
                    res = {"error": "timed out after 600 s"}
                results[workload].setdefault(name, []).append(res)
                if "error" in res:
                    print(f"  round {r + 1} {workload:5s} {name:22s} ERROR {res['error']}")
                else:
                    rate = res["samples"] / res["seconds"]
                    print(
                        f"  round {r + 1} {workload:5s} {name:22s} {rate:9.0f} samples/s",
                        flush=True,
                    )
    report = _report(results, mean_kb, skipped)
    report["config"] = {"count": count, "rounds": rounds, "workers": WORKERS, "quick": quick}
    report["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _median_rate(runs: list[dict[str, Any]]) -> float | None:
    ok = [r["samples"] / r["seconds"] for r in runs if "error" not in r and r["seconds"] > 0]
    return statistics.median(ok) if ok else None


def _median_cpu_us(runs: list[dict[str, Any]]) -> float | None:
    """Median CPU microseconds per sample (loader process + workers), where measured."""
    ok = [
        r["cpu_seconds"] / r["samples"] * 1e6
        for r in runs
        if "error" not in r and r.get("cpu_seconds") and r["samples"] > 0
    ]
    return statistics.median(ok) if ok else None


def _cpu_col(cpu: float | None, best_peer_cpu: float | None, ours: bool) -> str:
    """``CPU us/sample`` and, for fastload rows, the peer's CPU per sample over ours."""
    if cpu is None:
        return f"{'-':>9s} {'':>8s}"
    ratio = f"{best_peer_cpu / cpu:7.2f}x" if ours and best_peer_cpu else f"{'':>8s}"
    return f"{cpu:9.0f} {ratio}"


def _report(
    results: dict[str, dict[str, list[dict[str, Any]]]], mean_kb: float, skipped: dict[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": skipped, "workloads": {}}
    for workload, by_name in results.items():
        rates = {name: _median_rate(runs) for name, runs in by_name.items()}
        cpus = {name: _median_cpu_us(runs) for name, runs in by_name.items()}
        errors = {
            name: runs[-1]["error"] for name, runs in by_name.items() if _median_rate(runs) is None
        }
        print(f"\n== {workload} (medians of {max(len(r) for r in by_name.values())} rounds) ==")
        table: dict[str, Any] = {"rates": rates, "cpu_us_per_sample": cpus, "errors": errors}
        if workload == "bytes":
            pc = by_name.get("pagecache", [])
            pc_ok = [r["bytes"] / r["seconds"] for r in pc if "error" not in r]
            bw = statistics.median(pc_ok) if pc_ok else None
            table["pagecache_bytes_per_s"] = bw
            peers = [
                v for k, v in rates.items() if v and not k.startswith(("fastload", "pagecache"))
            ]
            best_peer = max(peers) if peers else None
            peer_cpus = [
                v for k, v in cpus.items() if v and not k.startswith(("fastload", "pagecache"))
            ]
            best_cpu = min(peer_cpus) if peer_cpus else None
            base = rates.get("torch")
            print(
                f"{'loader':22s} {'samples/s':>10s} {'MB/s':>8s} {'vs torch':>9s} {'vs best peer':>12s} {'of page cache':>13s} {'CPU us/s.':>9s} {'CPU gain':>8s}"
            )
            if bw:
                print(f"{'page cache (dd-like)':22s} {bw / mean_kb / 1e3:10.0f} {bw / 1e6:8.0f}")
            for name, rate in rates.items():
                if name == "pagecache":
                    continue
                if rate is None:
                    print(f"{name:22s} ERROR {errors.get(name, '')}")
                    continue
                mbs = rate * mean_kb / 1e3
                share = f"{mbs * 1e6 / bw * 100:12.1f}%" if bw else "-"
                vs_peer = _fmt_ratio(
                    rate / best_peer if best_peer and name.startswith("fastload") else None
                )
                cpu_col = _cpu_col(cpus.get(name), best_cpu, name.startswith("fastload"))
                print(
                    f"{name:22s} {rate:10.0f} {mbs:8.0f} {_fmt_ratio(rate / base if base else None):>9s} {vs_peer:>12s} {share:>13s} {cpu_col}"
                )
        else:
            single = rates.get("single-fused")
            limit = 2 * single if single else None
            table["two_core_limit"] = limit
            dali = rates.get("dali")
            peers = [
                v
                for k, v in rates.items()
                if v and k in ("torch", "webdataset", "litdata", "mosaic")
            ]
            best_peer = max(peers) if peers else None
            dali_cpu = cpus.get("dali")
            print(
                f"{'loader':22s} {'img/s':>8s} {'vs DALI':>8s} {'vs best PIL peer':>16s} {'of 2-core limit':>15s} {'CPU us/img':>9s} {'DALI/ours':>8s}"
            )
            for name, rate in rates.items():
                if rate is None:
                    print(f"{name:22s} ERROR {errors.get(name, '')}")
                    continue
                if name.startswith("single"):
                    print(f"{name:22s} {rate:8.0f}   (one core, no loader)")
                    continue
                vs_dali = _fmt_ratio(rate / dali if dali else None)
                vs_peer = _fmt_ratio(rate / best_peer if best_peer else None)
                of_limit = f"{rate / limit * 100:14.0f}%" if limit else "-"
                cpu_col = _cpu_col(cpus.get(name), dali_cpu, name.startswith("fastload"))
                print(
                    f"{name:22s} {rate:8.0f} {vs_dali:>8s} {vs_peer:>16s} {of_limit:>15s} {cpu_col}"
                )
            if limit:
                print(f"2-core limit (single-core fused x 2): {limit:.0f} img/s")
        out["workloads"][workload] = table
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return out


if __name__ == "__main__":
    sys.exit(main())
