"""The children of ``bench_loader``: one loader measurement each, in a fresh process.

``python -m benchmarks.bench_loader --child <spec>`` runs ``CHILDREN[kind]`` (with the
spec's ``workload`` and ``variant``) and prints its result line. Every loader child warms the page
cache with its data, then times **one whole epoch** of ``cfg["count"]`` samples with
:func:`~benchmarks._harness.time_epoch`: from the creation of the dataset and loader (start-up
included) to the last batch, with the first-batch time, the steady span after batch 2 and the CPU
time of the process tree (:func:`~benchmarks._harness.tree_cpu_seconds`). A loader that delivers
fewer samples than the corpus fails the run; one that delivers more (padding to full batches) is
stopped at the corpus size. The ``pagecache`` and ``single`` children are references, not loaders:
a second warm read of the shards, and one core decoding and augmenting without a loader.

The children of the peers' interpreter (``litdata``, ``mosaic``) import only this module,
:mod:`benchmarks._harness` and :mod:`benchmarks.corpus` from the repository.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import (
    check_labels,
    counting_labels,
    dali_batches,
    time_epoch,
    tree_cpu_seconds,
    warm,
)
from benchmarks.corpus import Corpus, FileBytes

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
WORKERS = 2

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


# ---------------------------------------------------------------------------------------------
# Children: one loader measurement each
# ---------------------------------------------------------------------------------------------


def _measure(make: Callable[[], Iterable[Any]], cfg: dict[str, Any]) -> dict[str, float]:
    """Time one whole epoch of the loader ``make()`` creates (:func:`time_epoch`: creation to the
    last of ``cfg["count"]`` samples, first batch, steady span after batch 2), with the CPU time
    of this process and its workers, and check that it delivered every sample once (its labels
    are the corpus's); this process's torch runs on one thread (the loader's workers or threads
    do the work)."""
    import torch

    torch.set_num_threads(1)
    counts: Counter[int] = Counter()
    result = time_epoch(counting_labels(make, counts), cfg["count"], cpu_clock=tree_cpu_seconds)
    check_labels(counts, corpus_labels(cfg))
    return result


def corpus_labels(cfg: dict[str, Any]) -> Counter[int]:
    """How many samples of each label one epoch of the corpus holds."""
    return Counter(label for _, label in Corpus(Path(cfg["root"]), cfg["count"]).files())


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

    def make() -> Iterable[Any]:
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
            ds = fl.open_dataset(
                cfg["wds"], seed=0, decode=Decoder(image=tf), fields=("jpg", "cls")
            )
            finish = tf.batch_transform
        loader = fl.DataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS, collate_fn=collate)
        if finish is None:
            return loader
        return ((finish(images), labels) for images, labels in loader)

    return _measure(make, cfg)


def child_torch(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    from torch.utils.data import DataLoader

    files = Corpus(Path(cfg["root"]), cfg["count"]).files()
    warm(p for p, _ in files)

    def make() -> Iterable[Any]:
        ds = FileBytes(files) if workload == "bytes" else FileTrain(files)
        return DataLoader(ds, batch_size=cfg["batch"], shuffle=True, num_workers=WORKERS)

    return _measure(make, cfg)


def child_webdataset(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import webdataset as wds

    shards = _shards(cfg)
    warm(shards)

    def make() -> Iterable[Any]:
        # Each worker reads every second shard (webdataset's default split_by_worker): the
        # epoch is every shard once; time_epoch checks that it delivers every sample.
        fn = _wds_label if workload == "bytes" else _wds_train
        ds = (
            wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False)
            .shuffle(1000)
            .map(fn)
            .batched(cfg["batch"], partial=True)
        )
        return wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)

    return _measure(make, cfg)


def child_litdata(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import litdata

    class LitDS(litdata.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            s = super().__getitem__(index)
            # litdata yields memoryviews, which workers cannot pickle
            return _as_workload(bytes(s["jpg"]), s["cls"], workload)

    warm(str(p) for p in Path(cfg["litdata"]).glob("*"))

    def make() -> Iterable[Any]:
        ds = LitDS(input_dir=cfg["litdata"], shuffle=True, seed=0, drop_last=False)
        return litdata.StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS)

    return _measure(make, cfg)


def child_mosaic(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    import streaming
    from torch.utils.data import DataLoader

    class MdsDS(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            s = super().__getitem__(index)
            return _as_workload(s["jpg"], s["cls"], workload)

    warm(str(p) for p in Path(cfg["mds"]).glob("*"))
    streaming.base.util.clean_stale_shared_memory()

    def make() -> Iterable[Any]:
        ds = MdsDS(local=cfg["mds"], shuffle=True, shuffle_seed=0, batch_size=cfg["batch"])
        return DataLoader(ds, batch_size=cfg["batch"], num_workers=WORKERS)

    return _measure(make, cfg)


def _dali_train(jpegs: Any) -> Any:
    """The train workload in DALI's CPU graph (inside a pipeline definition): fused
    crop-while-decoding (torchvision's RRC ranges), resize 224, flip, normalize to float CHW."""
    from nvidia.dali import fn, types

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


def child_dali(cfg: dict[str, Any], workload: str) -> dict[str, float]:
    from nvidia.dali import fn, pipeline_def

    root = cfg["folder"]
    warm(str(p) for p in Path(root).rglob("*.jpg"))
    batch, count = cfg["batch"], cfg["count"]

    @pipeline_def(batch_size=batch, num_threads=WORKERS, device_id=None, seed=0)  # type: ignore[misc]
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="files")
        return _dali_train(jpegs), labels

    def make() -> Iterable[Any]:
        p = pipe()
        p.build()
        if p.epoch_size("files") != count:
            raise RuntimeError(f"DALI's reader sees {p.epoch_size('files')} files, not {count}")
        # ceil(count / batch) batches, the last cut to the epoch's rest (the reader wraps)
        return dali_batches(p, count)

    return _measure(make, cfg)


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
        return _dali_train(fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1))

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
